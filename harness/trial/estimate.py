"""Predict a trial's peak memory without allocating it: the real training step on fake tensors.

The trial's own code builds the model, applies the strategies and runs warm-up and memory-window
steps exactly as training does, but under ``FakeTensorMode``: every tensor has a shape, dtype
and device and no storage, so a 7B-parameter model costs nothing to "train". ``MemTracker``
accounts the fake storages as it accounts real ones (and rounds CUDA blocks to 512 B), so the
prediction and the CPU measurement share one accounting.

What fake tensors lack (values read by a step or a constructor, libraries that take a fake
tensor for a trace, other ranks) is supplied by ``harness.trial.fake``.

Not predicted: ``adam8bit`` (its step is compiled code, which cannot run on fake tensors) and any
trial whose tensor *shapes* depend on values (``nonzero``, boolean masks). ``compile`` is
predicted eagerly, which is also what the memory window measures.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from harness.compat.internals import FakeTensorMode
from harness.contract import OPTIMIZER_STATE_BYTES
from harness.cuda.cards import Card
from harness.cuda.device_memory import FREE, DeviceMemory, Replayable
from harness.cuda.kernels import Workspaces
from harness.cuda.speed import card_roofline
from harness.meters.accounting import cuda_accounting, optimizer_state_bytes, storage_bytes
from harness.meters.allocations import AllocationLog, repeated_step
from harness.meters.block_tags import BlockTags
from harness.meters.memory import MemoryWindow
from harness.meters.op_costs import OpCostCounter
from harness.meters.roofline import Roofline, step_time
from harness.metrics import BREAKDOWN_CATEGORIES, breakdown_metric
from harness.strategies.base import Strategy, StrategyError
from harness.strategies.checkpoint import repeated_blocks
from harness.strategies.lora import NF4_BYTES_PER_PARAM, base_dtype, is_nf4
from harness.strategies.settings import DEFAULT_LORA
from harness.trial.calibrate import cpu_roofline
from harness.trial.config import TrialConfig
from harness.trial.depth import Make, deep_predictor, with_note
from harness.trial.distributed import Ranks
from harness.trial.fake import (
    FAKE_REFUSALS,
    ValuesReadAsOne,
    fake_process_group,
    libraries_run_eagerly,
)
from harness.trial.prediction import CardFigures, Prediction, SpeedFigures
from harness.trial.recompute import auto_strategy, block_order, choose
from harness.trial.setup import Setup, build_setup
from harness.trial.target import CudaTarget, cuda_rules, cuda_target, target_note
from harness.trial.window_trace import WindowTrace
from harness.units import format_bytes
from harness.workloads import describe_dataset

HOST_FRACTION = 0.8  # a CPU trial may use at most this share of the RAM available
# On a GPU, DDP's reducer copies its used-parameter map through a pinned host buffer and
# asserts on that buffer's pointer, which a fake tensor has not (the first card run, torch
# 2.11). A machine without a GPU predicts the same trial for a card (CPU kernels, CUDA's
# rules): that path has no such buffer.
DDP_ON_CUDA = (
    "ddp: DDP's reducer asserts on its pinned buffers, which fake CUDA tensors cannot satisfy; "
    "predict it as a machine without a GPU does (harness estimate --card)"
)


def estimate_peak(
    config: TrialConfig,
    device: torch.device,
    as_cuda: bool = False,
    strategies: tuple[Strategy, ...] | None = None,
) -> Prediction:
    """The predicted peak and its breakdown (``Prediction``); ``unpredictable`` with why when
    the step cannot run on fake tensors (``FAKE_REFUSALS``); ``refused`` with why when a strategy
    cannot apply to the model (the trial would end before training with the same message).
    Any other exception propagates: a crash is a bug to see, not a row to hide it in.

    ``as_cuda``: run on ``device``'s kernels (the CPU) but account storages as CUDA allocates
    them, for a CUDA target predicted on a machine without a GPU. A multi-rank trial is
    predicted for rank 0, which holds the largest slice of each batch, and under ``pp:N`` for
    the first rank of every stage (``Layout.roles``), the worst reported with every stage's
    peak; every rank computes the same prediction, so all take the same feasibility decision. ``strategies``: the trial's
    own strategy objects (``run.train`` builds them once), else built here.
    """
    strategies = strategies or config.strategy.build()
    roles = config.strategy.layout.roles()
    if len(roles) > 1:  # a pipeline: each stage holds its own memory
        stages = [estimate_role(config, device, as_cuda, strategies, r) for r in roles]
        return worst_stage(stages, bubble_factor(config))
    return estimate_role(config, device, as_cuda, strategies, roles[0])


def bubble_factor(config: TrialConfig) -> float:
    """How much longer a pipeline's step is than its slowest stage's work: the schedule's idle
    ramp-up and ramp-down (the bubble). With m micro-batches over p stages GPipe and 1F1B take
    m + p - 1 micro-batch slots for m micro-batches' work; interleaving v virtual stages per
    rank shrinks the ramp to (p - 1) / v slots."""
    term = config.strategy.term("pp")
    if term is None:
        return 1.0
    stages, micro = config.strategy.layout.size("pp"), config.strategy.pipeline_micro_batches
    virtual = 2 if term.option == "interleaved" else 1
    return (micro + (stages - 1) / virtual) / micro


def worst_stage(predictions: list[Prediction], bubble: float = 1.0) -> Prediction:
    """A pipeline's prediction: the stage that needs most memory (its figures and breakdown),
    with every stage's peak; the step as long as the slowest stage's work, stretched by the
    schedule's bubble. A stage's failure is the trial's."""
    for prediction in predictions:
        if not prediction.ok:
            return prediction
    worst = max(predictions, key=lambda p: p.judged_bytes or 0.0)
    speeds = [p.speed for p in predictions if p.speed is not None]
    speed = worst.speed
    if speed is not None and speeds:
        slowest = max(speeds, key=lambda s: s.step_time_ms)
        stretch = slowest.step_time_ms * bubble / speed.step_time_ms
        speed = replace(
            speed,
            step_time_ms=speed.step_time_ms * stretch,
            throughput=speed.throughput / stretch,
            mfu=speed.mfu / stretch,
        )
    peaks = tuple(p.peak_bytes or 0.0 for p in predictions)
    return replace(worst, stage_peaks=peaks, speed=speed)


def estimate_role(
    config: TrialConfig,
    device: torch.device,
    as_cuda: bool,
    strategies: tuple[Strategy, ...],
    rank: int,
) -> Prediction:
    """The prediction for ``rank``'s role on the mesh (``Layout.roles``)."""
    auto = auto_strategy(strategies)
    # A deep model from two shallow traces (harness.trial.depth); checkpoint:auto / sac:auto
    # try several plans, each warmed up afresh.
    make = predictor_maker(device, as_cuda, strategies, rank, rewarm=auto is not None)
    deep, note = deep_predictor(config, device, as_cuda, make)
    if deep is not None:
        with deep:
            if auto is not None:
                return choose(deep, config.batch_size, deep.budget())
            return deep.predict(config.batch_size)
    with Predictor(
        config, device, as_cuda, strategies=strategies, rewarm=auto is not None, rank=rank
    ) as predictor:
        if auto is not None:
            return choose(predictor, config.batch_size, predictor.budget())
        return with_note(predictor.predict(config.batch_size), note)


def predictor_maker(
    device: torch.device,
    as_cuda: bool,
    strategies: tuple[Strategy, ...],
    rank: int = 0,
    rewarm: bool = False,
    steps_run: int | None = None,
    totals: bool = False,
) -> Make:
    """How ``harness.trial.depth`` makes a ``Predictor`` of a configuration (at a shallow
    depth, its blocks tagged; or whole)."""

    def make(config: TrialConfig, tag_blocks: bool) -> Predictor:
        return Predictor(
            config,
            device,
            as_cuda,
            steps_run=steps_run,
            totals=totals,
            strategies=strategies,
            rewarm=rewarm,
            rank=rank,
            tag_blocks=tag_blocks,
        )

    return make


class Predictor:
    """One configuration built once on fake tensors, then predicted at any batch size.

    Building a model and its first optimizer step are most of a prediction's cost (an 8B
    QLoRA model: ~60 s to quantize its fake base, then ~20 s a step on 2 cores), and neither
    depends on the batch: parameters, gradients and optimizer state have the same shapes at
    every batch size, and the step leaves nothing batch-sized alive. So the model is built
    and warmed up once (at ``config``'s batch size), and each ``predict(b)`` runs only the
    memory window's steps at ``b``: the same steps, on the same state, as a fresh estimate at
    ``b`` (tests hold the two equal to the byte). A step that fails leaves the state unknown,
    so the next ``predict`` builds afresh.

    A window runs its first step only and files its later steps' allocations as that step's
    again (``repeated``): every step after the warm-up runs the same ops on the same state, so
    running them bought only time (tests hold the two equal, event for event).

    ``steps_run=1`` (the fit search) runs one of the memory window's steps, with all of its
    batches staged: after the warm-up every step starts from the same state and allocates the
    same, so the peak of one is the peak of all (tests hold it equal to a full window).
    ``totals=True`` (the fit search too) adds the live total after every op of the window to
    each prediction (``Prediction.totals``, ``TotalsTracker``).

    A CUDA target also gets what the card holds (``harness.cuda.device_memory``): every
    storage's allocation and free, in order, from the model's parameters through the warm-up
    step and the window (``AllocationLog``), replayed through the caching allocator's rules for
    its reserved bytes; plus the context and NCCL buffers for its device bytes
    (``Prediction.on_card``); the allocated figure is the replayed allocator's too, which counts
    the cuBLAS workspaces it serves and the block remainders too small to split, as
    ``max_memory_allocated`` does (*other* in the breakdown). Without a GPU the step runs under
    CUDA's autocast lists and kernels.
    """

    def __init__(
        self,
        config: TrialConfig,
        device: torch.device,
        as_cuda: bool = False,
        steps_run: int | None = None,
        totals: bool = False,
        strategies: tuple[Strategy, ...] | None = None,
        rewarm: bool = False,
        rank: int = 0,
        tag_blocks: bool = False,
    ) -> None:
        self.config, self.device, self.as_cuda = config, device, as_cuda
        self.tag_blocks = tag_blocks  # file each allocation event under its model block
        self.rank = rank  # whose role is predicted: a pipeline's stages differ
        self.steps_run, self.totals = steps_run, totals
        self.strategies = strategies or config.strategy.build()
        self.stack: contextlib.ExitStack | None = None
        self.setup: Setup | None = None
        self.failure: Prediction | None = None  # why no batch size can be predicted
        self.target: CudaTarget | None = (
            cuda_target(config, as_cuda, self.strategies)
            if as_cuda or device.type == "cuda"
            else None
        )
        # Whose speed the step is priced on: the card's, or this CPU's (calibrated once here,
        # outside the fake world the window runs in).
        self.roofline: Roofline | None = (
            card_roofline(self.target.card) if self.target is not None else cpu_roofline()
        )
        self.log: AllocationLog | None = None  # CUDA targets: every allocation, in order
        self.workspaces: Workspaces | None = None
        self.kernels: Any = None  # the CUDA kernels' choices (emulated targets)
        self.history_end = 0  # events before the first window (parameters, warm-up step)
        self.history_live: set[int] = set()  # allocations alive then
        self.tracked_peak = 0.0  # the last window's peak by tensor accounting alone
        self.trace: WindowTrace | None = None  # the last window's
        self.rewarm = rewarm
        self.built_end = 0  # events of the build: the parameters, the emptied cache
        self.built_live: set[int] = set()  # allocations alive then
        self.warm_start = 0  # where the last warm-up's events begin
        self.warmed_at: int | None = None  # the batch size of the last warm-up
        self.window_made: set[int] = set()  # allocations of the memory windows' steps
        self.values: ValuesReadAsOne | None = None  # the fake world's, once built
        self.build_seconds = 0.0  # what the last build (and its warm-up) took

    def __enter__(self) -> Predictor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.stack is not None:
            self.stack.close()
        self.stack, self.setup = None, None

    def build(self) -> None:
        """Enter the fake world, build the model, take the warm-up step."""
        config = self.config
        for info in sorted(config.strategy.infos, key=lambda info: info.name):
            if info.unpredictable is not None:
                self.failure = Prediction.unpredictable(f"{info.name}: {info.unpredictable}")
                return
        if self.device.type == "cuda" and "ddp" in {info.name for info in config.strategy.infos}:
            self.failure = Prediction.unpredictable(DDP_ON_CUDA)
            return
        if self.target is not None:  # a card too old for a strategy's kernels (float8)
            card = self.target.card
            refusal = config.strategy.card_refusal(card.name, card.compute_capability)
            if refusal:
                self.failure = Prediction.refused(refusal)
                return
        ranks = Ranks(
            rank=self.rank,
            size=config.world_size,
            launched=config.strategy.needs_process_group,
            layout=config.strategy.layout,
        )
        stack = contextlib.ExitStack()
        try:
            # Real tensors: user data is loaded (and a tokenizer read) to learn the batch's shape.
            self.info = describe_dataset(
                config.dataset, config.dataset_options, config.python_path, config.seed
            )
            for strategy in self.strategies:  # before the fake world (Strategy.load_libraries)
                strategy.load_libraries()
            if self.as_cuda:
                stack.enter_context(cuda_accounting())
            stack.enter_context(fake_process_group(ranks))
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            if self.target is not None:
                self.kernels = stack.enter_context(cuda_rules(self.target))
                self.workspaces = Workspaces(self.target.card)
                self.log = stack.enter_context(AllocationLog(self.device.type, self.workspaces))
            self.values = stack.enter_context(ValuesReadAsOne())
            watching = (
                self.log.watching_registrations()
                if self.log is not None and self.tag_blocks
                else contextlib.nullcontext()
            )
            with watching:
                setup = build_setup(config, self.device, ranks, self.info, None, self.strategies)
            stack.enter_context(libraries_run_eagerly())  # now that the model's code is loaded
            if self.log is not None and self.tag_blocks:
                self.log.blocks = block_tags(setup)
                if self.log.blocks is not None:
                    self.log.tag_what_was_built()
            if self.log is not None:  # the trial empties the cache after building (run.py),
                self.log.empty_cache()  # then the parameters as .to("cuda") placed them
                self.log.register([*setup.model.parameters(), *setup.model.buffers()])
                self.built_end = len(self.log.events)
                self.built_live = set(self.log.live_ids())
            self.warm(setup, config.batch_size)
        except StrategyError as error:  # the trial cannot run either: it ends before training
            stack.close()
            self.failure = Prediction.refused(str(error))
            return
        except FAKE_REFUSALS as error:  # value-dependent code cannot run on fake tensors
            stack.close()
            self.failure = Prediction.unpredictable(one_line(error))
            return
        except BaseException:  # a bug (harness's or the model's): a crash, traceback and all
            stack.close()
            raise
        self.stack, self.setup = stack, setup

    def warm(self, setup: Setup, batch_size: int) -> None:
        """One warm-up step at ``batch_size``: the optimizer state now exists."""
        if self.log is not None:
            self.warm_start = len(self.log.events)
        setup.train_step(setup.to_device(self.info.example_batch(batch_size)))
        self.warmed_at = batch_size
        if self.log is not None:
            self.history_end = len(self.log.events)
            self.history_live = set(self.log.live_ids())

    def budget(self) -> int | None:
        """The bytes a trial of this configuration may use (``device_memory``, else a CUDA
        target's card memory), judged as the trial judges them."""
        if self.target is not None:
            return self.target.budget(self.config)
        return self.config.device_memory_bytes

    def replanned(self) -> None:
        """The step changed (another recomputation plan, ``harness.trial.recompute``): the
        next prediction warms up again under it, as a fresh process would, where the warm-up
        shapes what is predicted (a CUDA target's allocator history)."""
        self.warmed_at = None

    def block_count(self) -> int:
        """How many blocks ``checkpoint:auto`` / ``sac:auto`` plan for (the built model's)."""
        strategy = auto_strategy(self.strategies)
        assert strategy is not None and strategy.recomputation is not None
        return len(strategy.recomputation.blocks)

    def block_order(self, batch_size: int) -> list[int]:
        """The order ``checkpoint:auto`` / ``sac:auto`` recompute the built model's blocks in."""
        return block_order(self, batch_size)

    def rewarmed(self, batch_size: int) -> bool:
        """Back to the state the build left (no gradients, no optimizer state), then warmed up
        at ``batch_size``: what the caching allocator saw is then a fresh process's (the build's
        events, then this warm-up's), without building the model again. False, and nothing
        run, when the state did not go back: something the build made is gone, or something a
        warm-up made is still alive (state a fresh process makes in its first step, which the
        warm-up would then not make again).

        What a memory window's step made and nothing frees may stay: a fresh process makes its
        own in its own window, and the replay never sees the old ones (they are in neither the
        build's events nor the new warm-up's). Under PEFT's gradient checkpointing each step
        leaves its embedding output and that output's gradient so, held from outside Python."""
        assert self.setup is not None and self.log is not None and self.workspaces is not None
        optimizer = self.setup.optimizer
        optimizer.zero_grad(set_to_none=True)
        for parameter in self.setup.model.parameters():
            parameter.grad = None
        optimizer.state.clear()
        gc.collect()  # a reference cycle may hold the last step's tensors
        live = set(self.log.live_ids()) - set(self.log.untracked)
        if not self.built_live <= live or not live - self.built_live <= self.window_made:
            return False
        self.workspaces.seen.clear()  # a fresh process allocates them in its first step
        self.warm(self.setup, batch_size)
        return True

    def predict(self, batch_size: int) -> Prediction:
        """The prediction at ``batch_size`` (see ``estimate_peak``)."""
        if self.setup is None and self.failure is None:
            started = time.perf_counter()
            self.build()
            self.build_seconds = time.perf_counter() - started
        if self.failure is not None:
            return self.failure
        assert self.setup is not None
        if self.rewarm and self.log is not None and batch_size != self.warmed_at:
            try:
                rewarmed = self.rewarmed(batch_size)
            except FAKE_REFUSALS as error:
                self.close()
                return Prediction.unpredictable(one_line(error))
            if not rewarmed:  # something of the last warm-up outlived it: build afresh
                self.close()
                self.config = replace(self.config, batch_size=batch_size)
                return self.predict(batch_size)
        config = replace(self.config, batch_size=batch_size)
        setup = replace(
            self.setup,
            config=config,
            samples_per_step=batch_size * self.info.tokens_per_sample // self.setup.ranks.size,
        )
        try:
            prediction = self.window(setup, config)
        except FAKE_REFUSALS as error:  # this batch's step failed: its state is not to be reused
            self.close()
            return Prediction.unpredictable(one_line(error))
        except BaseException:
            self.close()
            raise
        return prediction

    def predict_on(
        self, batch_size: int, cards: Sequence[Card], budgets: Mapping[str, int | None]
    ) -> dict[str, Prediction]:
        """The prediction at ``batch_size`` for each of ``cards`` that runs the target's step
        (``shares_trace``; the target's own card always does), all from one window, each
        judged against its budget (``budgets``: bytes by card name; None: the card's memory):
        a card left out needs a predictor of its own. A failure (refused, unpredictable) is
        every card's: nothing in it depends on the card."""
        prediction = self.predict(batch_size)
        if not prediction.ok:
            return {card.name: prediction for card in cards}
        own = self.target_card().name
        return {
            card.name: prediction if card.name == own else self.on_card(card, budgets[card.name])
            for card in cards
            if card.name == own or self.shares_trace(card)
        }

    def window(self, setup: Setup, config: TrialConfig) -> Prediction:
        """Run the memory window's steps at ``config``'s batch size and predict them for the
        target (the trace is kept for ``on_card``)."""
        staged = [
            setup.to_device(self.info.example_batch(config.batch_size))
            for _ in range(config.memory_steps)
        ]
        window = MemoryWindow(
            self.device,
            setup.model,
            setup.optimizer,
            [t for staged_batch in staged for t in staged_batch.values()],
            allocator_counters=False,
            totals=self.totals,
        )
        history, history_tags = self.history() if self.log is not None else ([], [])
        start = len(self.log.events) if self.log is not None else 0
        # The window's first step is priced: after the warm-up every step runs the same ops,
        # so a one-step window (the fit search's) prices exactly what a full one does.
        counter = OpCostCounter()
        steps = staged[: self.steps_run]
        step_start, first_end, repeats = start, 0, None
        with window:
            for index, staged_batch in enumerate(steps):
                if index == 1 and self.log is not None:  # the rest: the first one again
                    repeats = self.repeated(step_start, len(steps) - 1)
                    if repeats is not None:
                        first_end = len(self.log.events)
                        break
                step_start = len(self.log.events) if self.log is not None else 0
                # The values mode records for the counter: no dispatch mode of its own.
                counting = (
                    self.values.watching(counter.record) if self.values is not None else counter
                )
                with counting if index == 0 else contextlib.nullcontext():
                    setup.train_step(staged_batch, on_micro_batch=window.micro_batch_done)
        events: list[tuple[int, int]] = []
        tags: list[int] = []
        if self.log is not None:
            events, tags = self.log.events[start:], self.log.tags[start:]
            self.window_made.update(ident for ident, size in events if size >= 0)
            if repeats is not None:  # after the first step, before anything filed later
                events[first_end - start : first_end - start] = repeats
                step_tags = self.log.tags[step_start:first_end]
                tags[first_end - start : first_end - start] = step_tags * (len(steps) - 1)
        # This rank's parameters (frozen ones too) + a gradient for each trainable one + the
        # optimizer's persistent state.
        parameters = list(setup.model.parameters())
        assert window.reading is not None
        reading = window.reading.metrics()
        self.trace = WindowTrace(
            config=config,
            samples=setup.samples_per_step * setup.ranks.size,
            throughput_unit=setup.info.get("throughput_unit", "samples/s"),
            costs=counter.costs,
            peak=reading["peak_allocated_bytes"],
            breakdown={c: reading[breakdown_metric(c)] for c in BREAKDOWN_CATEGORIES},
            history=history,
            events=events,
            num_params=float(setup.num_params),
            num_params_total=float(setup.num_params_total),
            num_params_nf4=float(sum(p.numel() for p in parameters if is_nf4(p))),
            model_state=(
                storage_bytes(parameters)
                + storage_bytes(p for p in parameters if p.requires_grad)
                + optimizer_state_bytes(setup.optimizer)
            ),
            totals=window.totals_tracker.totals if window.totals_tracker is not None else None,
            history_tags=history_tags if self.tag_blocks else [],
            event_tags=tags if self.tag_blocks else [],
        )
        budget = self.target.budget(config) if self.target is not None else None
        return self.figures(self.trace, self.target, self.roofline, budget)

    def repeated(self, step_start: int, times: int) -> list[tuple[int, int]] | None:
        """The allocation events of ``times`` more steps, each the step filed from
        ``step_start`` on made again (``repeated_step``), without running them; None where a
        step cannot be repeated so (it changed the state), and they are run instead.

        Every step after the warm-up runs the same ops on the same state, so a window's later
        steps file what its first filed: running them bought nothing but time (a third of a
        batch size's prediction), and the caching allocator's replay still sees every step.
        Tests hold the repeated steps equal to run ones on every shipped configuration."""
        assert self.log is not None
        events = self.log.events  # extended (a copy) only where a further step follows
        added: list[tuple[int, int]] = []
        for count in range(times):
            again = repeated_step(events, step_start)
            if again is None:
                return None
            added.extend(again)
            if count + 1 < times:
                step_start, events = len(events), [*events, *again]
        return added

    def figures(
        self,
        trace: WindowTrace,
        target: CudaTarget | None,
        roofline: Roofline | None,
        budget: int | None,
    ) -> Prediction:
        """``trace`` predicted for ``target`` (None: the CPU) and its ``budget`` (bytes),
        priced on ``roofline``."""
        config = trace.config
        peak, breakdown = trace.peak, dict(trace.breakdown)
        on_card, replay = None, None
        if self.log is not None and target is not None:
            history, events = trace.history, trace.events
            if target.card.cublas_workspace_bytes != self.target_card().cublas_workspace_bytes:
                history, events = (
                    self.rebased(history, target.card),
                    self.rebased(events, target.card),
                )
            replayable = Replayable(
                history,
                events,
                target.allocator,
                target.card,
                config.world_size,
                config.strategy.needs_process_group,
            )
            # A fit search judges each of its budgets itself (``replay``): unbounded here.
            memory = replayable.device_memory(None if self.totals else budget)
            # max_memory_allocated counts blocks as the allocator hands them out: with the
            # cuBLAS workspaces it serves and the remainders too small to split off, which
            # tensor accounting does not see; they count as "other", as a measurement's do.
            self.tracked_peak = trace.peak
            peak = float(memory.allocated)
            breakdown["other"] += memory.allocated - trace.peak
            on_card = CardFigures(
                reserved_bytes=float(memory.reserved),
                device_bytes=float(memory.device),
                context_bytes=float(memory.context),
                nccl_bytes=float(memory.nccl),
                fragmentation_bytes=float(memory.fragmentation),
                workspace_bytes=float(self.workspaces.bytes_on(target.card))
                if self.workspaces is not None
                else 0.0,
                card=target.card.name,
                note=target_note(target, self.kernels),
                tracked_peak_bytes=trace.peak,  # what fit's moments model
            )
            if self.totals:
                replay = replayable
        return Prediction(
            peak_bytes=peak,
            breakdown=breakdown,
            num_params=trace.num_params,
            num_params_total=trace.num_params_total,
            num_params_nf4=trace.num_params_nf4,
            model_state_bytes=trace.model_state,
            totals=trace.totals,
            on_card=on_card,
            speed=self.speed(trace, roofline),
            replay=replay,
        )

    def target_card(self) -> Card:
        assert self.target is not None
        return self.target.card

    def shares_trace(self, card: Card) -> bool:
        """Whether the step traced for the target is ``card``'s step too, so ``on_card`` may
        predict it from the same trace: a CUDA target, the same vendor, and every attention
        call on the backend ``card`` would choose (on a real GPU, whose own kernels ran: the
        same compute capability). The cuBLAS workspace, the other card-dependent allocation,
        is resized in the replay."""
        if self.target is None or card.vendor != self.target.card.vendor:
            return False
        if self.config.strategy.card_refusal(card.name, card.compute_capability):
            return False  # refused there: a predictor of its own says so
        if self.kernels is None:
            return card.compute_capability == self.target.card.compute_capability
        return bool(self.kernels.chooses_alike(card.compute_capability))

    def retarget(self, card: Card, budget: int | None) -> bool:
        """Predict for ``card`` (under ``budget`` bytes; None: its memory) from the next batch
        size on, on the model already built: the build does not depend on the card (no kernel
        runs in it whose choice does), so a card whose step differs from the target's (another
        attention backend) costs warm-ups and windows, not another build (an 8B QLoRA model:
        20 s of quantizing). Each next ``predict`` warms up again under the card's kernels and
        workspaces. False, and nothing changed, where that cannot be: no fake CUDA target, or
        no warm-up again (``rewarm``)."""
        if not self.rewarm or self.target is None or self.kernels is None:
            return False
        if self.workspaces is None or self.failure is not None:
            return False
        if self.config.strategy.card_refusal(card.name, card.compute_capability):
            return False  # refused there: a predictor of its own says so
        self.target = replace(self.target, card=card, card_named=True)
        self.config = replace(
            self.config, card=card.to_dict(), device_memory_bytes=budget or card.memory_bytes
        )
        self.kernels.retarget(card.compute_capability)
        self.workspaces.cublas = card.cublas_workspace_bytes
        self.roofline = card_roofline(card)
        self.warmed_at = None  # the last warm-up was the other card's
        return True

    def on_card(self, card: Card, budget: int | None = None) -> Prediction:
        """The last window's prediction for ``card`` (``shares_trace`` holds) under ``budget``
        (bytes; None: the card's memory): its memory, context and roofline, nothing run
        again."""
        assert self.trace is not None and self.target is not None
        target = replace(self.target, card=card, card_named=True)
        budget = budget or card.memory_bytes
        return self.figures(self.trace, target, card_roofline(card), budget)

    def rebased(self, events: list[tuple[int, int]], card: Card) -> list[tuple[int, int]]:
        """``events`` with each cuBLAS workspace at ``card``'s size."""
        assert self.log is not None and self.workspaces is not None
        cublas = {
            ident
            for ident, kind in zip(self.log.untracked, self.workspaces.kinds, strict=False)
            if kind == "cublas"
        }
        size = card.cublas_workspace_bytes
        return [(ident, size if ident in cublas and n >= 0 else n) for ident, n in events]

    def speed(self, trace: WindowTrace, roofline: Roofline | None) -> SpeedFigures | None:
        """The window's ops priced on ``roofline``: one step's time, the trial's throughput
        (every rank's samples), and MFU at the trial's dtype; None for a card whose catalogue
        entry gives no peak or bandwidth to price them on."""
        if roofline is None:
            return None
        timed = step_time(trace.costs, roofline)
        unmodelled = list(timed.unmodelled)
        if timed.collectives_unpriced:
            unmodelled.insert(0, "collectives (no link bandwidth)")
        return SpeedFigures(
            step_time_ms=timed.seconds * 1000,
            throughput=trace.samples / timed.seconds,
            throughput_unit=trace.throughput_unit,
            mfu=timed.mfu(roofline, trace.config.dtype),
            step_flops=timed.flops,
            model_flops=timed.model_flops,
            device=roofline.name,
            unmodelled_ops=", ".join(unmodelled),
        )

    def history(self) -> tuple[list[tuple[int, int]], list[int]]:
        """What the allocator saw before this window, and each event's block tag: the
        parameters and the warm-up step, then (after earlier windows of other batch sizes) the
        change of what is alive since, as frees and allocations: the state a fresh process
        would enter the window in."""
        assert self.log is not None
        log = self.log
        events = [*log.events[: self.built_end], *log.events[self.warm_start : self.history_end]]
        tags = [*log.tags[: self.built_end], *log.tags[self.warm_start : self.history_end]]
        now = {ident: size for ident, size in log.live.values()}
        gone = sorted(self.history_live - now.keys())
        new = sorted(now.keys() - self.history_live)
        events += [(ident, FREE) for ident in gone] + [(ident, now[ident]) for ident in new]
        tags += [log.tag_of.get(ident, -1) for ident in (*gone, *new)]
        return events, tags


def block_tags(setup: Setup) -> BlockTags | None:
    """The hooks that tag each allocation event with its model block (None: no repeated
    blocks, and no extension by depth)."""
    try:
        _, blocks = repeated_blocks(setup.model)
    except StrategyError:
        return None
    return BlockTags(setup.model, blocks, setup.optimizer)


def replay_for_budget(replayable: Replayable, budget: int) -> DeviceMemory | None:
    """A prediction's device figures under a cap of another budget (``Prediction.replay``), for
    one whose unbounded figure exceeds it: None when even freeing the cache and retrying does
    not fit."""
    return replayable.capped(budget)


def one_line(error: Exception) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:200]


def available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_guard(predicted_peak: float, device: torch.device) -> str | None:
    """Why a CPU trial must not run (it would swap or be OOM-killed), or ``None``."""
    if device.type != "cpu":
        return None
    available = available_host_bytes()
    if available is None or predicted_peak <= HOST_FRACTION * available:
        return None
    return (
        f"predicted peak {format_bytes(predicted_peak)} exceeds {HOST_FRACTION:.0%} of the "
        f"{format_bytes(available)} of host RAM available"
    )


def closed_form(config: TrialConfig, prediction: Prediction) -> dict[str, float]:
    """Textbook cross-checks: model-state bytes from bytes per parameter, and (gpt) activations
    by Korthikanti et al. 2022, ``s*b*h*(34 + 5*a*s/h)`` per layer in 16-bit (full recomputation
    keeps ~``2*s*b*h``).

    Model state: each trainable parameter costs its weight and gradient (4 + 4 B in fp32) plus
    the optimizer's state; a frozen one (lora/qlora base) only its stored bytes: 2 B in bf16,
    and under qlora NF4's 4 bits plus one 8-bit scale per 64 values plus one fp32 scale per 256
    scales (Dettmers et al. 2023: 0.127 bit/param) = 0.5159 B/param.
    """
    num_params = prediction.num_params
    assert num_params is not None, "closed forms need a prediction's parameter counts"
    total = prediction.num_params_total
    frozen = (num_params if total is None else total) - num_params
    nf4 = prediction.num_params_nf4 or 0.0
    infos = config.strategy.infos
    optimizer = next(
        (info.name for info in infos if info.group == "optimizer"), config.optimizer.name
    )
    if optimizer == "sgd" and config.optimizer.momentum:
        optimizer = "sgd_momentum"
    scale = math.prod(info.state_bytes_factor for info in infos)
    if any(info.shards_state for info in infos):  # per rank: a 1/N shard of everything
        scale /= config.world_size
    state = OPTIMIZER_STATE_BYTES[optimizer]
    base_bytes = base_dtype(config.lora or DEFAULT_LORA, config.dtype).itemsize
    frozen_bytes = nf4 * NF4_BYTES_PER_PARAM + (frozen - nf4) * base_bytes
    out = {"closed_form_model_state_bytes": (num_params * (8 + state) + frozen_bytes) * scale}
    knobs = config.knobs
    chosen = config.strategy.chooses_for_budget  # its plan is the prediction's, not a formula's
    if {"n_layer", "d_model", "n_head", "seq_len"} <= knobs.keys() and not chosen:
        s, b, h, a = knobs["seq_len"], config.batch_size, knobs["d_model"], knobs["n_head"]
        per_layer = (
            2 * s * b * h
            if any(info.keeps_block_inputs_only for info in infos)
            else s * b * h * (34 + 5 * a * s / h)
        )
        out["korthikanti_activation_bytes"] = math.ceil(per_layer * knobs["n_layer"])
    return out


def device_note(config: TrialConfig, as_cuda: bool) -> str:
    """Which device-specific choices the prediction made, so a reader can judge it."""
    foreach = config.optimizer.foreach
    choices = f"optimizer foreach={foreach} fused=False (fixed, as in training)"
    if as_cuda:
        return f"cuda target on CPU kernels (no GPU here): 512-B block rounding; {choices}"
    return choices


def estimate_row(
    config: TrialConfig, index: int, request: dict[str, Any], device: torch.device, as_cuda: bool
) -> dict[str, Any]:
    """One row of ``python -m harness.trial.estimate``: the prediction (or why there is none)
    and the closed-form cross-checks (the config is all it needs of the request)."""
    prediction = estimate_peak(config, device, as_cuda)
    note = "; ".join(filter(None, (device_note(config, as_cuda), prediction.note)))
    fields = {k: v for k, v in prediction.to_dict().items() if k != "note"}
    row = {"trial_key": config.trial_key, **fields, "note": note}
    if prediction.ok:
        row.update(closed_form(config, prediction))
    return row


if __name__ == "__main__":
    import sys

    from harness.trial.tool import serve

    # IN: {"device": "cpu"|"cuda", "configs": [TrialConfig dicts]}; OUT: one row per config.
    sys.exit(
        serve(
            sys.argv[1:],
            estimate_row,
            "estimated",
            "estimate_seconds",
            "batch {config.batch_size} ",
        )
    )
