"""A spec's grid as trials: the points (one value per axis), each point's ``TrialConfig``, and
the hash that says whether a spec still describes the same sweep."""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path
from typing import Any

from harness.cuda.cards import CATALOGUE
from harness.spec.errors import SpecError, did_you_mean
from harness.spec.schema import MAX_BATCH, Spec
from harness.trial.config import TrialConfig


def points(spec: Spec) -> list[dict[str, Any]]:
    """Every grid point in grid order, each mapping axis name to value. Once ``batch_size: max``
    is resolved, a ``max`` that found a batch the grid also lists is that very trial: once."""
    axes = spec.axes()
    every = [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]
    return [
        point
        for point in every
        if not (point["batch_size"] == MAX_BATCH and batch_of(spec, point)[0] in axes["batch_size"])
    ]


def max_batch_key(point: dict[str, Any]) -> tuple[str, str, str]:
    """What ``batch_size: max`` is resolved for: the point's model size, dtype, strategy."""
    return (point["model_size"], point["dtype"], point["strategy"])


def batch_of(spec: Spec, point: dict[str, Any]) -> tuple[int, str | None]:
    """The batch a point trains at, and for ``max`` how it was found (``Spec._max_batch``).
    Unresolved (planning that needs no batch, e.g. the world size) the smallest allowed batch
    stands in, and says so."""
    value = point["batch_size"]
    if value != MAX_BATCH:
        return int(value), None
    found = spec._max_batch.get(max_batch_key(point))
    if found is None:
        return spec.grid.combination(point["strategy"]).batch_step, f"{MAX_BATCH}: not resolved"
    return int(found["batch_size"]), str(found["search"])


def trial_config(spec: Spec, point: dict[str, Any]) -> TrialConfig:
    """The trial at one grid point (``batch_size: max``: the resolved batch, see ``batch_of``)."""
    size = point["model_size"]
    combination = spec.grid.combination(point["strategy"])
    batch_size, batch_size_search = batch_of(spec, point)
    spec_dir = str(Path(spec._source).resolve().parent) if spec._source else str(Path.cwd())
    return TrialConfig(
        experiment=spec.experiment,
        model_family=spec.model.family,
        model_size=size,
        model_knobs=dict(spec.model.sizes[size]),
        dataset=spec.data.dataset,
        data_options=spec.data.options(),
        batch_size=batch_size,
        dtype=point["dtype"],
        strategy=combination,
        optimizer=spec.train.optimizer.settings(),
        budget=spec.train.budget.budget(),
        seed=spec.train.seed,
        warmup_steps=spec.measure.warmup_steps,
        memory_steps=spec.measure.memory_steps,
        timed_steps=spec.measure.timed_steps,
        device=spec._hardware["device"] if spec._hardware else spec.device,
        device_memory_bytes=spec.memory_budget,
        model_loss=spec.model.loss,
        hardware=dict(spec._hardware) if spec._hardware else None,
        # train.lora only where an adapter strategy reads it (other trials keep their keys)
        lora=spec.train.lora.settings() if combination.has_group("adapters") else None,
        python_path=[spec_dir, str(Path.cwd())],
        run_infeasible=spec.limits.run_infeasible,
        timeline=spec.measure.timeline,
        allocator_snapshot=spec.measure.allocator_snapshot,
        batch_size_search=batch_size_search,
        card=card.to_dict() if (card := spec.card_entry) is not None else None,
        allocator=spec.allocator,
    )


def trial_configs(spec: Spec) -> list[TrialConfig]:
    return [trial_config(spec, point) for point in points(spec)]


def on_hardware(spec: Spec, hardware: dict[str, str]) -> Spec:
    """The spec as a sweep on this host runs it: its trials carry the resolved device and its
    name in their identity (``TrialConfig.hardware``)."""
    copy = spec.model_copy()
    copy._source = spec._source
    copy._hardware = dict(hardware)
    copy._max_batch = dict(spec._max_batch)
    return copy


def with_max_batch(spec: Spec, found: dict[tuple[str, str, str], dict[str, Any]]) -> Spec:
    """The spec with ``batch_size: max`` resolved (``found``: see ``Spec._max_batch``)."""
    copy = spec.model_copy()
    copy._source = spec._source
    copy._hardware = dict(spec._hardware) if spec._hardware is not None else None
    copy._max_batch = dict(found)
    return copy


def with_card(spec: Spec, card: str | None, cards: str | None = None) -> Spec:
    """The spec planned for another card (``--card``, ``--cards``: a cards file relative to the
    working directory); ``SpecError`` naming the option when the card is unknown."""
    from harness.spec.load import resolve_cards

    if card is None and cards is None:
        return spec
    update: dict[str, Any] = {}
    if card is not None:
        update["card"] = card
    if cards is not None:
        update["cards"] = str(Path(cards).resolve())
    copy = spec.model_copy(update=update)
    copy.__pydantic_private__ = dict(spec.__pydantic_private__ or {})
    resolve_cards(copy, spec._source)
    known = sorted({*CATALOGUE, *copy._cards})
    if copy.card is not None and copy.card.lower() not in known:
        raise SpecError(
            f"--card: unknown card {copy.card!r} (known: {', '.join(known)})"
            f"{did_you_mean(copy.card, known)}"
        )
    return copy


def grid_hash(spec: Spec) -> str:
    """Identifies the set of trials: the same spec resumes its sweep, a changed grid (or other
    hardware) starts anew."""
    keys = sorted(config.trial_key for config in trial_configs(spec))
    return hashlib.sha256("\n".join(keys).encode()).hexdigest()[:10]
