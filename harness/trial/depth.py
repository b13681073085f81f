"""A deep model predicted from two shallow copies of it: its repeated block traced once.

An 8B Llama's 32 blocks are one block 32 times, and tracing all of them is most of a
prediction's time (16 s of an 8B LoRA estimate on 2 cores). The model is traced at
``SHALLOW`` and ``SHALLOW + 1`` blocks instead (its first and last blocks, which may differ
from the rest, and middle blocks between them), and every figure is carried to the full depth:

- what tensor accounting counts (the peak, its breakdown, model state, parameter counts) grows
  by the same amount with each block: the difference of the two traces, once per block more;
- the ops priced for speed: the deeper trace's, with the ops the extra block added once more
  per block (a multiset: their order prices nothing);
- what the card's caching allocator does is not additive (segments round to 2 and 20 MiB), so
  the allocation log itself is extended (``harness.meters.block_repeat``: the middle block's
  events filed again in each sweep, every free aimed at its counterpart) and replayed at full
  depth, as a full trace's log would be.

Nothing is assumed that is not checked first, on this very model: the log of the shallower
trace, extended by one block, must equal the deeper trace's event for event; the peak by tensor
accounting of the extended log must equal the carried peak (less what the log holds that
tensor accounting never saw, the same at both shallow depths; else the peak moved to another
moment of the step as blocks were added: a block's activations overtaking the optimizer's
peak, say); blocks must file alike. Where any check fails, or the model is not made of one
repeated block (``repeated_blocks``), the caller traces it whole and the note says why.
Only CUDA targets take this path (the allocator replay is what needs the log, and a card is
what deep models are predicted for); a CPU target is traced whole.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from harness.cuda.speed import card_roofline
from harness.meters.accounting import allocated_bytes
from harness.meters.block_repeat import (
    FREE,
    Irregular,
    canonical,
    extend,
    smoothed,
)
from harness.meters.op_costs import StepCosts
from harness.trial.config import TrialConfig
from harness.trial.prediction import Prediction
from harness.trial.recompute import auto_strategy, block_keys, in_order
from harness.trial.window_trace import WindowTrace

SHALLOW = 5  # blocks of the shallower trace; the deeper has one more
MIDDLE = 2  # the block copied: its neighbours are middle blocks too, in both traces
# FSDP's blocks refer two blocks away (a block's backward waits on the reduce-scatter the
# block above issued): the copied block's neighbours two away must be middle blocks too.
SHARDED_SHALLOW, SHARDED_MIDDLE = 7, 3


def shallow_depth(config: TrialConfig) -> tuple[int, int]:
    """How many blocks the shallower trace has, and which block is copied."""
    if any(info.shards_state for info in config.strategy.infos):
        return SHARDED_SHALLOW, SHARDED_MIDDLE
    return SHALLOW, MIDDLE


MIN_DEPTH = 12  # shallower models are traced whole: the two traces would cost as much
TRACE_WHOLE = "HARNESS_TRACE_WHOLE"  # set (to anything): every model traced whole, as before


@dataclass(frozen=True)
class Depth:
    """Where a configuration's depth is set (the knob) and how deep it is."""

    knob: str
    blocks: int
    extra: dict[str, Any]  # other knobs that list one value per block, cut with the depth

    def at(self, config: TrialConfig, blocks: int) -> TrialConfig:
        knobs = {**config.model_knobs, self.knob: blocks}
        for name, values in self.extra.items():
            knobs[name] = list(values[:blocks])
        return replace(config, model_knobs=knobs)


def depth_of(config: TrialConfig) -> Depth | str | None:
    """The configuration's depth, where its family sets one by a knob and its blocks are
    alike by construction; why not where its blocks differ; None where its family sets none
    (all three: traced whole)."""
    knobs = config.knobs
    if config.model_family == "gpt":
        return Depth("n_layer", int(knobs["n_layer"]), {})
    if config.model_family == "timm" and "depth" in knobs:
        return Depth("depth", int(knobs["depth"]), {})
    if config.model_family == "hf":
        from harness.workloads.hf import load_config

        hf_config = load_config(dict(knobs), list(config.python_path or []))
        blocks = getattr(hf_config, "num_hidden_layers", None)
        if not isinstance(blocks, int):
            return None
        extra: dict[str, Any] = {}
        for name, value in vars(hf_config).items():
            if isinstance(value, list | tuple) and len(value) == blocks and blocks > 1:
                if any(item != value[0] for item in value):  # sliding-window layers among full
                    kinds = ", ".join(sorted({str(item) for item in value}))
                    return f"its blocks differ ({name}: {kinds})"
                extra[name] = value
        return Depth("num_hidden_layers", blocks, extra)
    return None


Make = Callable[[TrialConfig, bool], Any]  # a Predictor of a configuration (tagging blocks?)
# checkpoint:auto / sac:auto: a plan that recomputes some blocks in full and not others is no repeat
# of one block, so its model is traced whole (the plans that treat every block alike are
# carried: every block in full, none).
MIXED_PLAN = "traced whole: a plan that recomputes some blocks in full and not others"
# Once the whole model is built for a mixed plan, every later plan runs on it: a window on a
# built model costs less than two shallow builds and their windows (a QLoRA base quantized),
# and no shallow model is built beside it (two fake worlds cannot stand side by side).
BUILT_WHOLE = "traced whole: the whole model was built for a mixed plan already"
# One shallow trace: what its window ran, its library workspaces, its attention calls so far.
Shot = tuple[WindowTrace, frozenset[int], Counter[str]]


def deep_predictor(
    config: TrialConfig, device: torch.device, as_cuda: bool, make: Make, min_depth: int = MIN_DEPTH
) -> tuple[DeepPredictor | None, str]:
    """A ``DeepPredictor`` for ``config``, or None and why not where its blocks differ ("" where
    the shortcut does not apply at all: a shallow model, a CPU target, a family without a
    depth knob). ``make(config, tag_blocks)``: a ``Predictor`` (passed in:
    ``harness.trial.estimate`` calls this module)."""
    if not (as_cuda or device.type == "cuda") or os.environ.get(TRACE_WHOLE):
        return None, ""
    depth = depth_of(config)
    if isinstance(depth, str):
        return None, f"traced whole: {depth}"
    if depth is None:
        return None, ""
    low, _ = shallow_depth(config)
    if depth.blocks < max(min_depth, low + 2):
        return None, ""
    if config.strategy.term("pp") is not None:
        return None, "traced whole: pipeline stages"
    return DeepPredictor(config, depth, make), ""


class DeepPredictor:
    """A deep configuration predicted from two shallow models (``Predictor``'s own API, where
    ``harness estimate``, ``plan`` and ``fit`` use it: ``predict``, ``predict_on``,
    ``retarget``, ``close``; for ``checkpoint:auto`` / ``sac:auto`` also ``replanned``,
    ``block_count``, ``block_order``), at every batch size and card they are asked for. The
    two are built afresh for each batch size, one after the other (each lives in a fake world
    of its own, which cannot stand beside another's); at a few blocks a build costs a second.
    Where a check fails, it says why in the note and predicts the whole model from then on
    (built once, on the same strategies). An auto plan that treats blocks unalike is predicted
    by the whole model (``mixed``, built when first needed, warmed up again at each plan)."""

    def __init__(self, config: TrialConfig, depth: Depth, make: Make) -> None:
        self.config, self.depth, self.make = config, depth, make
        self.low, self.middle = shallow_depth(config)
        self.pair: list[Any] = []  # the window's two predictors (closed)
        self.attention: list[Counter[str]] = []  # their attention calls, by backend
        self.strategies = make(config, False).strategies  # nothing built until predicted
        self.whole: Any = None  # the full model's Predictor, once the shortcut failed
        self.why = ""  # why it failed
        self.auto = auto_strategy(self.strategies)
        self.mixed: Any = None  # the full model's Predictor for an auto plan's mixed plans
        # (the auto plan, batch size) -> both shallow traces and their predictors (prepare)
        self.ready: dict[tuple[str | None, int], tuple[list[Shot], list[Any]]] = {}
        self.expected: list[int] = []  # the batch sizes a caller means to ask for (expect)
        self.costly_build = False  # the last builds cost more than their windows

    def __enter__(self) -> DeepPredictor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for predictor in (self.whole, self.mixed):
            if predictor is not None:
                predictor.close()

    def plan(self) -> str | None:
        """What the auto strategy does to every block ("" without one); None where its plan
        treats blocks unalike."""
        return "" if self.auto is None else self.auto.uniform_mode()

    def carries(self) -> bool:
        """Whether the next prediction is carried from shallow traces: the shortcut has not
        failed, the auto plan (if any) treats every block alike, and the whole model is not
        built already."""
        return self.whole is None and self.mixed is None and self.plan() is not None

    def whole_predictor(self, batch_size: int) -> tuple[Any, str]:
        """The full model's ``Predictor`` where a prediction is not carried, and why not: the
        shortcut failed, the auto plan treats blocks unalike, or the model is built already."""
        if self.whole is not None:
            return self.whole, self.why
        if self.mixed is None:
            self.mixed = self.make(replace(self.config, batch_size=batch_size), False)
        return self.mixed, MIXED_PLAN if self.plan() is None else BUILT_WHOLE

    def predict(self, batch_size: int) -> Prediction:
        if self.carries():
            window = self.window(batch_size)
            if isinstance(window, WindowTrace):
                deeper = self.pair[1]
                config = replace(self.config, batch_size=batch_size)
                return self.on(window, deeper.target, deeper.target.budget(config))
        predictor, why = self.whole_predictor(batch_size)  # the window gave up, or a mixed plan
        return with_note(predictor.predict(batch_size), why)

    def predict_on(
        self, batch_size: int, cards: Sequence[Any], budgets: Mapping[str, int | None]
    ) -> dict[str, Prediction]:
        """``Predictor.predict_on``: every card in ``cards`` that runs the traced step."""
        if self.carries():
            window = self.window(batch_size)
            if isinstance(window, WindowTrace):
                deeper = self.pair[1]
                own = deeper.target.card.name
                config = replace(self.config, batch_size=batch_size)
                out: dict[str, Prediction] = {}
                for card in cards:
                    if card.name == own:
                        out[card.name] = self.on(
                            window, deeper.target, deeper.target.budget(config)
                        )
                    elif deeper.shares_trace(card):
                        target = replace(deeper.target, card=card, card_named=True)
                        out[card.name] = self.on(
                            window, target, budgets[card.name] or card.memory_bytes
                        )
                return out
        predictor, why = self.whole_predictor(batch_size)  # the window gave up, or a mixed plan
        return {
            name: with_note(prediction, why)
            for name, prediction in predictor.predict_on(batch_size, cards, budgets).items()
        }

    def replanned(self) -> None:
        """``Predictor.replanned``: the whole models warm up again under the next plan (the
        shallow ones are built for each window, and their traces are kept by plan)."""
        for predictor in (self.whole, self.mixed):
            if predictor is not None:
                predictor.replanned()

    def block_count(self) -> int:
        return self.depth.blocks

    def block_order(self, batch_size: int) -> list[int]:
        """``Predictor.block_order`` of the full model, from a shallow copy's: its first and
        last blocks ranked as they are, its middle blocks (alike, so one rank: the full
        model's middle blocks are the same block) standing for every middle block; where
        they rank apart, the full model's own."""
        built = self.whole or self.mixed
        if built is not None:  # no shallow model beside a built whole one
            if built.setup is None:
                built.build()
            return built.block_order(batch_size)
        config = self.depth.at(replace(self.config, batch_size=batch_size), self.low)
        with self.make(config, False) as shallow:
            shallow.build()
            keys = block_keys(shallow, batch_size) if shallow.setup is not None else []
        if len(keys) == self.low and len(set(keys[1:-1])) == 1:
            middle = [keys[1]] * (self.depth.blocks - 2)
            return in_order([keys[0], *middle, keys[-1]])
        mixed, _ = self.whole_predictor(batch_size)
        if mixed.setup is None:
            mixed.build()
        return mixed.block_order(batch_size)

    def budget(self) -> int | None:
        """``Predictor.budget``: the bytes a trial of the configuration may use."""
        return self.make(self.config, False).budget()

    def retarget(self, card: Any, budget: int | None) -> bool:
        """``Predictor.retarget``: the next windows for ``card`` (the shallow models are built
        for each window anyway)."""
        if self.whole is not None and not self.whole.retarget(card, budget):
            return False
        if self.mixed is not None and not self.mixed.retarget(card, budget):
            self.mixed.close()  # built again when a mixed plan is next asked for
            self.mixed = None
        self.ready.clear()  # traced under the last card's kernels
        self.config = replace(
            self.config, card=card.to_dict(), device_memory_bytes=budget or card.memory_bytes
        )
        return True

    def window(self, batch_size: int) -> WindowTrace | None:
        """Both shallow steps at ``batch_size``, carried to the full depth; None where that
        failed (and ``whole`` predicts from then on)."""
        ready = self.ready.pop((self.plan(), batch_size), None)
        if ready is None:
            later = [size for size in self.expected if size >= batch_size]
            self.prepare(later if self.costly_build and later else [batch_size])
            ready = self.ready.pop((self.plan(), batch_size), None)
        if ready is None:
            return self.give_up(batch_size, "")  # the whole model answers for itself
        shots, self.pair = ready
        traces = [trace for trace, _, _ in shots]
        workspaces = [made_once for _, made_once, _ in shots]
        self.attention = [attention for _, _, attention in shots]
        try:
            return carried(traces, workspaces, self.depth.blocks, self.config, self.middle)
        except Irregular as error:
            return self.give_up(batch_size, f"traced whole: {error}")

    def expect(self, batch_sizes: Sequence[int]) -> None:
        """The batch sizes the caller means to ask for (``harness plan``'s): where a build
        costs more than a window, ``window`` traces the ones still to come on one build."""
        self.expected = sorted(set(batch_sizes))

    def prepare(self, batch_sizes: Sequence[int]) -> None:
        """Trace both shallow models at each of ``batch_sizes``, one model after the other,
        each built once and warmed up again at every batch (a ``Predictor`` made to rewarm),
        for ``window`` to carry: a costly build (QLoRA quantizing its NF4 base) is then paid
        twice per configuration, not twice per batch size. A batch whose shallow step fails is
        left out (``window`` then gives up on it)."""
        sizes = sorted(set(batch_sizes))
        if self.whole is not None or not sizes:
            return
        # A fake world beside the whole model's open one would file into its log too.
        assert self.mixed is None, "no shallow model is built beside the whole one"
        shots: dict[int, list[Shot]] = {size: [] for size in sizes}
        pair: list[Any] = []
        build = window = 0.0
        for blocks in (self.low, self.low + 1):
            config = self.depth.at(replace(self.config, batch_size=sizes[0]), blocks)
            with self.make(config, True) as predictor:
                pair.append(predictor)
                for size in sizes:
                    started = time.perf_counter()
                    prediction = predictor.predict(size)
                    window += time.perf_counter() - started
                    if not prediction.ok or predictor.trace is None:
                        continue
                    backends = predictor.kernels.backends if predictor.kernels else {}
                    made_once = frozenset(predictor.log.untracked)
                    shots[size].append((predictor.trace, made_once, Counter(backends)))
                build += predictor.build_seconds
        plan = self.plan()
        for size, shot in shots.items():
            if len(shot) == 2:
                self.ready[plan, size] = (shot, pair)
        self.costly_build = build > window - build

    def give_up(self, batch_size: int, why: str) -> None:
        self.why = why
        self.whole = self.make(replace(self.config, batch_size=batch_size), False)

    def on(self, trace: WindowTrace, target: Any, budget: int | None) -> Prediction:
        """The carried ``trace`` on ``target``'s card, its note counting the full depth's
        attention calls."""
        deeper = self.pair[1]
        kernels = deeper.kernels
        kept = Counter(kernels.backends) if kernels is not None else None
        if kernels is not None:
            more = self.depth.blocks - (self.low + 1)
            low, high = self.attention
            for backend, count in high.items():
                kernels.backends[backend] = count + (count - low[backend]) * more
        try:
            prediction = deeper.figures(trace, target, card_roofline(target.card), budget)
        finally:
            if kernels is not None and kept is not None:
                kernels.backends.clear()
                kernels.backends.update(kept)
        note = (
            f"traced {self.low} and {self.low + 1} of {self.depth.blocks} blocks, the rest repeated"
        )
        return with_note(prediction, note)


def with_note(prediction: Prediction, note: str) -> Prediction:
    if prediction.on_card is None or not note:
        return prediction
    card = prediction.on_card
    return replace(
        prediction, on_card=replace(card, note="; ".join(filter(None, (card.note, note))))
    )


def carried(
    traces: Sequence[WindowTrace],
    workspaces: Sequence[frozenset[int]],
    blocks: int,
    config: TrialConfig,
    middle: int,
) -> WindowTrace:
    """The deeper of two traces (one block apart; ``workspaces``: each one's library
    workspaces) carried to ``blocks`` blocks by copies of block ``middle``; ``Irregular`` where
    a check fails."""
    shallow, deeper = traces
    fixed = workspaces[1]
    if not deeper.event_tags or not any(tag >= 0 for tag in deeper.event_tags):
        raise Irregular("no repeated blocks found")
    one_more = _extended(shallow, 1, workspaces[0], middle)
    if canonical(one_more[0] + one_more[1]) != canonical(deeper.history + deeper.events) or (
        len(one_more[0]) != len(deeper.history)
    ):
        raise Irregular("a block more does not file what one block filed")
    if one_more[2] != smoothed(
        deeper.history + deeper.events, deeper.history_tags + deeper.event_tags
    ):
        raise Irregular("a block more is not tagged as one block was")
    more = blocks - len({tag for tag in deeper.event_tags if tag >= 0})
    history, events, _ = _extended(deeper, more, fixed, middle)

    def grown(low: float, high: float) -> float:
        return high + (high - low) * more

    peak = grown(shallow.peak, deeper.peak)
    # The log may hold a few tensors tensor accounting never saw (made before the window and
    # kept from outside Python: PEFT's checkpointed embedding output): a constant offset.
    offsets = {
        tracked_peak(trace.history, trace.events, made_once) - trace.peak
        for trace, made_once in zip(traces, workspaces, strict=True)
    }
    if len(offsets) != 1:
        raise Irregular("the log's live bytes do not follow tensor accounting's peak")
    offset = offsets.pop()
    if tracked_peak(history, events, fixed) - offset != peak:
        raise Irregular("the peak falls elsewhere in the step at full depth")
    return WindowTrace(
        config=config,
        samples=deeper.samples,
        throughput_unit=deeper.throughput_unit,
        costs=grown_costs(shallow.costs, deeper.costs, more),
        peak=peak,
        breakdown={
            key: grown(shallow.breakdown[key], value) for key, value in deeper.breakdown.items()
        },
        history=history,
        events=events,
        num_params=grown(shallow.num_params, deeper.num_params),
        num_params_total=grown(shallow.num_params_total, deeper.num_params_total),
        num_params_nf4=grown(shallow.num_params_nf4, deeper.num_params_nf4),
        model_state=grown(shallow.model_state, deeper.model_state),
        # fit's moments: the live total after every allocation of the full-depth log (not
        # tensor accounting's after every op: that list is not carried), as fit asks for them
        totals=live_totals(history, events, fixed, offset) if deeper.totals is not None else None,
    )


def _extended(
    trace: WindowTrace, more: int, fixed: frozenset[int], middle: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[int]]:
    """A trace's history and window, ``more`` blocks deeper, and their tags."""
    events = trace.history + trace.events
    out = extend(
        events,
        smoothed(events, trace.history_tags + trace.event_tags),
        middle,
        more,
        boundary=len(trace.history),
        fixed=fixed,
    )
    return out.events[: out.boundary], out.events[out.boundary :], out.tags


def grown_costs(shallow: StepCosts, deeper: StepCosts, more: int) -> StepCosts:
    """The deeper step's ops and ``more`` times those one block added (order prices nothing)."""
    if shallow.steps != deeper.steps:
        raise Irregular("the two traces priced different numbers of steps")
    low, high = Counter(shallow.calls), Counter(deeper.calls)
    if low - high:
        raise Irregular("a block more dropped an op the shallower step ran")
    block = high - low
    calls = list(deeper.calls)
    for call, count in block.items():
        calls.extend([call] * (count * more))
    return StepCosts(calls=calls, steps=deeper.steps)


def live_totals(
    history: Sequence[tuple[int, int]],
    window: Sequence[tuple[int, int]],
    fixed: frozenset[int],
    offset: float,
) -> list[int]:
    """The bytes tensors hold after every allocation of ``window`` (after ``history``), as
    ``tracked_peak`` counts them, less ``offset`` (what tensor accounting never saw)."""
    live: dict[int, int] = {}
    total = -int(offset)
    out: list[int] = []
    cuda = torch.device("cuda")
    for index, (ident, size) in enumerate([*history, *window]):
        if size >= 0 and ident not in fixed:
            live[ident] = allocated_bytes(size, cuda)
            total += live[ident]
            if index >= len(history):
                out.append(total)
        elif size == FREE:
            total -= live.pop(ident, 0)
    return out


def tracked_peak(
    history: Sequence[tuple[int, int]], window: Sequence[tuple[int, int]], fixed: frozenset[int]
) -> float:
    """The most bytes tensors hold at once in ``window`` (after ``history``), each allocation
    rounded as CUDA's allocator rounds it and library workspaces (``fixed``) left out: what
    tensor accounting's peak counts."""
    cuda = torch.device("cuda")
    live: dict[int, int] = {}
    total = 0
    for ident, size in history:
        if size >= 0 and ident not in fixed:
            live[ident] = allocated_bytes(size, cuda)
            total += live[ident]
        elif size == FREE:
            total -= live.pop(ident, 0)
    peak = total
    for ident, size in window:
        if size >= 0 and ident not in fixed:
            live[ident] = allocated_bytes(size, cuda)
            total += live[ident]
            peak = max(peak, total)
        elif size == FREE:
            total -= live.pop(ident, 0)
    return float(peak)
