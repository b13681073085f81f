"""A spec's grid as trials: the points (one value per axis), each point's ``TrialConfig``, and
the hash that says whether a spec still describes the same sweep."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import product
from pathlib import Path
from typing import Any

from harness.cuda.cards import CATALOGUE
from harness.spec.errors import SpecError, did_you_mean
from harness.spec.schema import MAX_BATCH, Spec
from harness.trial.config import TrialConfig

# What a ``batch_size: max`` resolves to per (model size, dtype, strategy): the batch it
# trains at and how it was found, ``{"batch_size": int, "search": str, ...}``.
MaxBatches = Mapping[tuple[str, str, str], Mapping[str, Any]]


@dataclass(frozen=True)
class SweepPlan:
    """A spec's grid as a sweep on one host runs it: the spec as the user wrote it, what the
    sweep resolved (the host's hardware, ``batch_size: max``), and, computed once from those,
    the points, their trial configs by key and the grid hash.

    The user's ``Spec`` carries no sweep state: ``harness.sweep.prepare`` builds the plan
    (``on_hardware``, ``with_max_batch``) and passes it down; planning that resolves nothing
    (estimates, validation) uses ``SweepPlan(spec)``.
    """

    spec: Spec
    # The device this host resolves ``device`` to and its name, part of every trial's
    # identity (``harness.trial.hardware.host_hardware``); None: not probed (estimates).
    hardware: Mapping[str, str] | None = None
    max_batch: MaxBatches = field(default_factory=dict)

    def on_hardware(self, hardware: Mapping[str, str]) -> SweepPlan:
        """The plan as a sweep on this host runs it (``TrialConfig.hardware``)."""
        return replace(self, hardware=dict(hardware))

    def with_max_batch(self, found: MaxBatches) -> SweepPlan:
        """The plan with ``batch_size: max`` resolved (``found``: see ``MaxBatches``)."""
        return replace(self, max_batch=dict(found))

    @cached_property
    def points(self) -> list[dict[str, Any]]:
        """Every grid point in grid order, each mapping axis name to value. Once ``batch_size:
        max`` is resolved, a ``max`` that found a batch the grid also lists is that very trial:
        once."""
        axes = self.spec.axes()
        every = [dict(zip(axes, values, strict=True)) for values in product(*axes.values())]
        return [
            point
            for point in every
            if not (
                point["batch_size"] == MAX_BATCH and self.batch_of(point)[0] in axes["batch_size"]
            )
        ]

    @cached_property
    def by_key(self) -> dict[str, tuple[dict[str, Any], TrialConfig]]:
        """Each point and its trial config by ``trial_key``, in grid order."""
        pairs = ((point, self.trial_config(point)) for point in self.points)
        return {config.trial_key: (point, config) for point, config in pairs}

    @property
    def configs(self) -> list[TrialConfig]:
        return [config for _, config in self.by_key.values()]

    @cached_property
    def grid_hash(self) -> str:
        """Identifies the set of trials: the same spec resumes its sweep, a changed grid (or
        other hardware) starts anew."""
        keys = sorted(self.by_key)
        return hashlib.sha256("\n".join(keys).encode()).hexdigest()[:10]

    def batch_of(self, point: Mapping[str, Any]) -> tuple[int, str | None]:
        """The batch a point trains at, and for ``max`` how it was found. Unresolved (planning
        that needs no batch, e.g. the world size) the smallest allowed batch stands in, and
        says so."""
        value = point["batch_size"]
        if value != MAX_BATCH:
            return int(value), None
        found = self.max_batch.get(max_batch_key(point))
        if found is None:
            step = self.spec.grid.combination(point["strategy"]).batch_step
            return step, f"{MAX_BATCH}: not resolved"
        return int(found["batch_size"]), str(found["search"])

    def trial_config(self, point: Mapping[str, Any]) -> TrialConfig:
        """The trial at one grid point (``batch_size: max``: the resolved batch, ``batch_of``)."""
        spec, hardware = self.spec, self.hardware
        size = point["model_size"]
        combination = spec.grid.combination(point["strategy"])
        batch_size, batch_size_search = self.batch_of(point)
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
            device=hardware["device"] if hardware else spec.device,
            device_memory_bytes=spec.memory_budget,
            model_loss=spec.model.loss,
            hardware=dict(hardware) if hardware else None,
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


def max_batch_key(point: Mapping[str, Any]) -> tuple[str, str, str]:
    """What ``batch_size: max`` is resolved for: the point's model size, dtype, strategy."""
    return (point["model_size"], point["dtype"], point["strategy"])


# A spec's grid with nothing resolved (estimates, validation, dry runs before a host probe).
def points(spec: Spec) -> list[dict[str, Any]]:
    return SweepPlan(spec).points


def trial_config(spec: Spec, point: Mapping[str, Any]) -> TrialConfig:
    return SweepPlan(spec).trial_config(point)


def trial_configs(spec: Spec) -> list[TrialConfig]:
    return SweepPlan(spec).configs


def grid_hash(spec: Spec) -> str:
    return SweepPlan(spec).grid_hash


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
