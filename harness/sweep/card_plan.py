"""``harness plan``: every grid point on each card, what fits, ranked by predicted throughput.

The predictions are ``harness estimate``'s, made by the trial layer's planning tool
(``python -m harness.trial.card_plan``): one model build per configuration, one warm-up and
window per batch size, one trace for every card whose step is the same (the figures equal a
fresh estimate's on each card). This module asks for them, judges each point against its card's
budget and ranks what fits.

``cpu`` is a card too: the host, its step priced on its calibrated roofline.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from harness.analyse.plan_front import judged_memory
from harness.contract import CPU_CARD
from harness.cuda.cards import CATALOGUE
from harness.cuda.margin import CARD_MARGIN
from harness.spec import Spec, SpecError, SweepPlan, with_card
from harness.sweep.estimate import COLUMNS, run_trial_tool
from harness.sweep.fit import default_jobs
from harness.sweep.prepare import resolve_max_batch
from harness.trial.config import TrialConfig
from harness.units import format_bytes

PLAN_COLUMNS = [
    "card",
    "rank",
    "fits",
    "budget_bytes",
    *[c for c in COLUMNS if c not in ("card", "fits")],
]


@dataclass(frozen=True)
class CardSweep:
    """The grid as planned on one card: its configs (``max`` batches resolved for it) and the
    bytes a point may use on it (None: no budget, every point counts as fitting)."""

    card: str
    configs: list[TrialConfig]
    budget: int | None


def on_card(spec: Spec, card: str, cards_file: str | None) -> CardSweep:
    """``spec`` planned for ``card`` (``cpu``: this host)."""
    if card == CPU_CARD:
        cpu = spec.model_copy(update={"card": None, "device": "cpu"})
        cpu.__pydantic_private__ = dict(spec.__pydantic_private__ or {})
        sweep = resolve_max_batch(SweepPlan(cpu), "cpu")
        budget = int(cpu.device_memory) if cpu.device_memory is not None else None
        return CardSweep(card, sweep.configs, budget)
    planned = with_card(spec, card, cards_file)
    planned = planned.model_copy(update={"device": "cuda"})
    planned.__pydantic_private__ = dict(spec.__pydantic_private__ or {})
    sweep = resolve_max_batch(SweepPlan(planned), "cuda")
    return CardSweep(card, sweep.configs, planned.memory_budget)


def group_key(config: TrialConfig) -> str:
    """A configuration without its card and batch size: what one model build serves."""
    data = config.to_dict()
    data.update(card=None, batch_size=0, device=None, device_memory_bytes=None)
    return json.dumps(data, sort_keys=True, default=str)


def kernel_class(config: TrialConfig, card: str) -> str:
    """Which cards are likely to run one step (``Predictor.shares_trace``), so that the
    planner's processes take them apart, each with a build of its own: the CPU; a card that
    may run attention on cuDNN (compute capability 9.0, 10.0, 10.3: PyTorch prefers it there);
    the other cards of its vendor. Two configurations' worth of work balance over the
    processes better than one twice as long, and a second build costs less than the warm-ups
    and windows either needs. The planner checks each trace itself; a card guessed wrong is
    traced again on the same build (``Predictor.retarget``)."""
    if card == CPU_CARD:
        return "cpu"
    entry = config.card or {}
    major, minor = entry.get("compute_capability") or (0, 0)
    cudnn_first = major in (9, 10) and minor in (0, 3)
    return f"{entry.get('vendor', 'nvidia')}{'-cudnn' if cudnn_first else ''}"


def likely_cost(config: TrialConfig, batches: dict[str, list[int]]) -> float:
    """A configuration group's work, relatively: its batch sizes, heavier for an NF4 base (its
    step dispatches three times the ops) and for recomputation."""
    weight = 3.0 if "qlora" in config.strategy_text else 1.0
    weight *= 1.3 if {"checkpoint", "sac"} & set(config.strategy.names) else 1.0
    return weight * len(set().union(*map(set, batches.values())))


def plan_grid(
    spec: Spec, cards: list[str], cards_file: str | None = None, every: bool = False
) -> pd.DataFrame:
    """One row per grid point and card: the prediction (``harness estimate``'s columns), the
    card, its budget, whether the point ``fits`` it, and ``rank`` (1 = the highest predicted
    throughput among the points that fit that card). Unless ``every``, a configuration's
    batch sizes above one that exceeds a card are not predicted on it (``skipped`` says why;
    they do not fit)."""
    planned = [on_card(spec, card, cards_file) for card in cards]
    groups: dict[str, tuple[TrialConfig, dict[str, list[int]]]] = {}
    for sweep in planned:
        for config in sweep.configs:
            key = group_key(config) + kernel_class(config, sweep.card)
            base, batches = groups.setdefault(key, (config, {}))
            batches.setdefault(sweep.card, []).append(config.batch_size)
    points = sum(len(sweep.configs) for sweep in planned)
    print(
        f"planning {points} points ({len(groups)} configurations x batch sizes) on "
        f"{', '.join(cards)} ...",
        file=sys.stderr,
        flush=True,
    )
    request = {
        "device": "cuda" if any(card != CPU_CARD for card in cards) else "cpu",
        "configs": [base.to_dict() for base, _ in groups.values()],
        "groups": [{"batches": batches} for _, batches in groups.values()],
        "cards": {s.card: s.configs[0].card for s in planned if s.card != CPU_CARD and s.configs},
        # Judged as if each card were smaller by the safety margin (the auto plans' choice,
        # the batch sizes left unpredicted above one that does not fit) and replayed so.
        "budgets": {
            s.card: None if s.budget is None else int(CARD_MARGIN.usable(s.budget))
            for s in planned
            if s.card != CPU_CARD
        },
        "every": every,
        # Likely slowest first: the queue ends on short ones, leaving no core idle.
        "order": sorted(range(len(groups)), key=lambda i: -likely_cost(*list(groups.values())[i])),
    }
    answers = run_trial_tool("harness.trial.card_plan", request, "the planner", default_jobs())
    rows = []
    for (base, _), answer in zip(groups.values(), answers, strict=True):
        for found in answer["rows"]:
            rows.append(
                {
                    "model_size": base.model_size,
                    "dtype": base.dtype,
                    "strategy": base.strategy_text,
                    "device": "cpu" if found["card"] == CPU_CARD else "cuda",
                    "estimate_seconds": answer["plan_seconds"],
                    **found,
                }
            )
    frame = pd.DataFrame(rows)
    budgets = {sweep.card: sweep.budget for sweep in planned}
    frame["budget_bytes"] = frame["card"].map(budgets).astype("Float64")
    judged = judged_memory(frame)
    usable = frame["budget_bytes"].copy()
    on_cards = frame["card"].ne(CPU_CARD) & usable.notna()
    usable[on_cards] = usable[on_cards].map(CARD_MARGIN.usable)
    frame["safety_margin_bytes"] = (frame["budget_bytes"] - usable).where(on_cards)
    fits = (judged <= usable).astype("boolean")
    fits = fits.where(judged.notna())  # no prediction: not known
    fits = fits.where(frame["budget_bytes"].notna(), judged.notna())
    if "skipped" in frame:  # a smaller batch of the configuration already exceeded the card
        fits = fits.mask(frame["skipped"].notna(), False)
    frame["fits"] = fits
    order = {card: index for index, card in enumerate(cards)}
    frame = frame.sort_values(
        ["card", "fits", "predicted_throughput"],
        key=lambda column: column.map(order) if column.name == "card" else column,
        ascending=[True, False, False],
        na_position="last",
        kind="stable",
    )
    frame["rank"] = pd.array([pd.NA] * len(frame), dtype="Int64")
    for card in cards:
        ranked = frame.index[frame["card"].eq(card) & frame["fits"].fillna(False).astype(bool)]
        ranked = [i for i in ranked if pd.notna(frame.at[i, "predicted_throughput"])]
        frame.loc[ranked, "rank"] = range(1, len(ranked) + 1)
    frame = frame.reset_index(drop=True)
    return frame.reindex(columns=[c for c in [*PLAN_COLUMNS, "skipped"] if c in frame.columns])


def configuration(row: Any) -> str:
    """A point in words: ``lora:16+checkpoint at batch 2`` (size and dtype when they vary are
    the caller's to add)."""
    return f"{row['strategy']} at batch {int(row['batch_size'])}"


def trade_line(frame: pd.DataFrame, card: str) -> str:
    """What the card's best point is and what the runner-up trades, in one line, e.g.
    ``rtx-4090 (24 GiB): 3 of 28 points fit; best lora:16+checkpoint at batch 1 (1,575
    tokens/s, 20.3 GiB); runner-up qlora:16+checkpoint at batch 2 fits too, 27 % slower than
    lora:16+checkpoint at batch 1, 4.78 GiB less memory``."""
    rows = frame[frame["card"].eq(card)]
    ranked = rows[rows["rank"].notna()].sort_values("rank")
    budget = rows["budget_bytes"].iloc[0] if len(rows) else None
    where = f"{card} ({format_bytes(budget, short=True)})" if pd.notna(budget) else card
    if ranked.empty:
        predicted = rows["predicted_peak_bytes"].notna().sum()
        return f"{where}: none of the {len(rows)} points fits ({predicted} predicted)"
    memory = judged_memory(ranked)
    best = ranked.iloc[0]
    unit = str(best.get("throughput_unit") or "samples/s")
    line = (
        f"{where}: {len(ranked)} of {len(rows)} points fit; best {configuration(best)} "
        f"({best['predicted_throughput']:,.0f} {unit}, {format_bytes(memory.iloc[0], short=True)})"
    )
    if len(ranked) < 2:
        return line
    second = ranked.iloc[1]
    slower = 1 - second["predicted_throughput"] / best["predicted_throughput"]
    saved = memory.iloc[0] - memory.iloc[1]
    memory_words = (
        f"{format_bytes(abs(saved), short=True)} {'less' if saved > 0 else 'more'} memory"
        if saved
        else "the same memory"
    )
    return (
        f"{line}; runner-up {configuration(second)} fits too, {slower * 100:.0f} % slower than "
        f"{configuration(best)}, {memory_words}"
    )


def known_cards() -> list[str]:
    return [CPU_CARD, *CATALOGUE]


def with_gpus(spec: Spec, gpus: int) -> Spec:
    """``spec`` with every configuration on ``gpus`` cards: the cards its tensor and pipeline
    ranks (``tp:T``, ``pp:P``, kept as written) do not take are data-parallel replicas, D =
    gpus / (T x P): each ``ddp``/``fsdp`` N set to D; a configuration without one gains
    ``ddp:D`` (``fsdp:D`` beside ``tp``, which DDP cannot take; ``none`` becomes ``ddp:D``;
    nothing is added for one replica). The grid's batch sizes stay per card, so the trials'
    batch (all replicas together) is ``gpus`` times theirs; ``max`` stays ``max``."""
    from harness.spec.load import parse_spec, read_yaml

    source = spec._source
    data = read_yaml(Path(source), "spec")
    grid = data["grid"]
    texts = []
    for combination in spec.grid.strategy:
        layout = combination.layout
        model_parallel = layout.size("tp") * layout.size("pp")
        if gpus % model_parallel:
            raise SpecError(
                f"--gpus {gpus}: {combination.text} needs a multiple of its {model_parallel} "
                "tensor x pipeline ranks"
            )
        dp = gpus // model_parallel
        terms = [
            f"{term.name}:{dp}" if term.info.mesh_dim == "dp" and term.number else term.text
            for term in combination.terms
        ]
        if dp > 1 and not combination.has_group("parallel"):
            added = "fsdp" if "tp" in combination.names else "ddp"
            terms = [term for term in terms if term != "none"] + [f"{added}:{dp}"]
        texts.append(terms[0] if len(terms) == 1 else terms)
    grid["strategy"] = [t for i, t in enumerate(texts) if t not in texts[:i]]
    grid["batch_size"] = [b * gpus if isinstance(b, int) else b for b in grid["batch_size"]]
    try:
        return parse_spec(data, source)
    except SpecError as error:
        raise SpecError(f"--gpus {gpus}: {error}") from None


def shortlist(sweep: SweepPlan, top: int) -> list[tuple[str, int]]:
    """``harness sweep --top K``: the sweep's points planned on the device it runs on, the
    ``top`` that fit ranked by predicted throughput, as ``(trial_key, rank)``, best first."""
    from harness.cuda.cards import card_for_device_name

    spec, hardware = sweep.spec, sweep.hardware or {}
    device = hardware.get("device", spec.device).split(":")[0]
    if device == "cpu":
        card = CPU_CARD
    else:
        known = card_for_device_name(hardware.get("device_name", ""))
        card = spec.card or (known.name if known else "")
        if not card:
            raise SpecError(
                f"--top: cannot price {hardware.get('device_name', 'this GPU')}: it is not in "
                "the catalogue; name its card in the spec (card:, cards:)"
            )
    frame = plan_grid(spec, [card])  # the spec's own cards file is already read
    ranked = frame[frame["rank"].notna()].sort_values("rank")
    by_point = {
        (config.model_size, config.dtype, config.strategy_text, config.batch_size): key
        for key, (_, config) in sweep.by_key.items()
    }
    chosen = []
    for _, row in ranked.iterrows():
        point = (row["model_size"], row["dtype"], row["strategy"], int(row["batch_size"]))
        if point in by_point:
            chosen.append((by_point[point], int(row["rank"])))
    return chosen[:top]


def note_shortlist(study: Any, sweep: SweepPlan, top: int | None) -> None:
    """``harness sweep --top K``: the K points ``harness plan`` ranks best on this hardware,
    noted on the study (``StudyAttr.PLANNED``) so every worker runs them first
    (``plan.SearchPlan``); without ``--top`` an earlier shortlist is dropped."""
    from harness.sweep.claim import StudyAttr

    if not top:
        if study.user_attrs.get(StudyAttr.PLANNED):
            study.set_user_attr(StudyAttr.PLANNED, [])
        return
    chosen = shortlist(sweep, top)
    study.set_user_attr(StudyAttr.PLANNED, [[key, rank] for key, rank in chosen])
    print(
        f"--top {top}: the {len(chosen)} point(s) predicted fastest among those that fit run first",
        file=sys.stderr,
        flush=True,
    )
