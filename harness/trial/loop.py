"""Training one built trial: warm up, measure memory, time steps, train to budget, evaluate.

The phases are separate on purpose (docs/measuring.md): the optimizer state exists only after the
first step, so memory is measured after warm-up; tensor accounting slows steps, so timing runs
in a window of its own. Every measured step is also a real training step and counts toward the
budget.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness.compat import memtracker as tracker
from harness.compat.internals import TORCH_VERSION
from harness.meters.accuracy import evaluate
from harness.meters.communication import collective_ms
from harness.meters.contention import ContentionMeter
from harness.meters.energy import EnergyMeter, combine
from harness.meters.host import peak_rss_bytes
from harness.meters.memory import MemoryWindow
from harness.meters.timing import StepTimer, synchronize
from harness.trial.config import SNAPSHOT_FILE, STEP_TIMES_FILE, TIMELINE_FILE
from harness.trial.curve import Curve, is_language_model, with_perplexity
from harness.trial.distributed import Ranks
from harness.trial.result import Status, TrialFailure, TrialResult
from harness.trial.setup import Setup
from harness.units import format_bytes
from harness.workloads.tensors import Batch, SplitData, batches, steps_per_epoch


@dataclass
class Measurements:
    """What a trial has measured so far; kept when it ends early (``oom``, ``diverged``)."""

    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=lambda: {"torch_version": TORCH_VERSION})
    loss_history: list[float] = field(default_factory=list)
    # train.budget.eval_every: the held-out evaluations during training (``Curve.history``).
    eval_history: list[dict[str, float]] = field(default_factory=list)
    # CUDA: bytes the planned card holds beside the caching allocator (its context, NCCL), as
    # predicted: the budget left for the allocator is device_memory minus these.
    outside_bytes: int = 0
    # The peak predicted for this rank's own role (a pipeline stage's), where predicted.
    own_prediction: float | None = None

    @contextlib.contextmanager
    def clock(self, metric: str, device: torch.device | None = None) -> Iterator[None]:
        """Wall time of one phase (the device synchronised, where there is one yet), so a
        sweep's own overhead can be told from training time."""
        if device is not None:
            synchronize(device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if device is not None:
                synchronize(device)
            self.metrics[metric] = time.perf_counter() - start

    def result(self, trial_key: str, status: Status, reason: str, ranks: Ranks) -> TrialResult:
        """The trial's result, with the worst rank's host memory; leaves the process group."""
        self.metrics["peak_rss_bytes"] = float(ranks.maximum(peak_rss_bytes()))
        ranks.stop()
        return TrialResult(
            trial_key=trial_key,
            status=status,
            failure_reason=reason,
            metrics={k: v for k, v in self.metrics.items() if math.isfinite(v)},
            loss_history=self.loss_history,
            eval_history=self.eval_history,
            info=self.info,
        )


class TrainingLoop:
    """The phases of training a ``Setup`` on ``data``, recording into ``measured``."""

    def __init__(
        self,
        setup: Setup,
        data: SplitData,
        measured: Measurements,
        output_dir: Path | None = None,
    ) -> None:
        self.setup = setup
        self.data = data
        self.measured = measured
        # Where the memory timeline, the step times (and on CUDA the allocator snapshot) go;
        # None: nowhere.
        self.output_dir = output_dir
        config = setup.config
        self.per_epoch = steps_per_epoch(data.train_size, config.batch_size)
        self.stream = batches(data.train, config.batch_size, config.seed)
        self.language_model = is_language_model(config.model_family, setup.task)
        every = config.budget.eval_every
        self.curve = (
            None if every is None else Curve(every, self.score, setup.device, config.budget.target)
        )
        self.train_start = 0.0  # perf_counter at the first training step

    def run(self) -> None:
        config, setup, metrics = self.setup.config, self.setup, self.measured.metrics
        budget = config.budget.total_steps(self.per_epoch)
        measured = config.warmup_steps + config.memory_steps + config.timed_steps
        measured += self.setup.ranks.size > 1  # the step whose communication is profiled
        with self.measured.clock("train_time_s", setup.device):
            self.train_start = time.perf_counter()
            self.warm_up(config.warmup_steps)
            self.checkpoint()
            self.measure_memory(config.memory_steps)
            self.checkpoint()
            self.measure_speed(config.timed_steps)
            self.train_rest(max(budget, measured) - measured)
        curve = self.curve
        evaluating_s = 0.0 if curve is None else curve.spent_s  # evaluations between steps
        metrics["train_time_s"] -= evaluating_s
        with self.measured.clock("eval_time_s", setup.device):
            # Every rank evaluates the whole held-out split (sharded models need all ranks in
            # each forward); the results agree, rank 0 reports them.
            metrics.update(self.final_quality(metrics["train_time_s"]))
            for strategy in setup.strategies:
                metrics.update(strategy.after_training(setup.model, setup.context))
        metrics["eval_time_s"] += evaluating_s
        if curve is not None:
            metrics.update(curve.metrics())
            self.measured.eval_history = curve.history()
        losses = self.measured.loss_history
        last_epoch = losses[-self.per_epoch :]
        metrics["train_loss"] = sum(last_epoch) / len(last_epoch)
        metrics["train_steps"] = float(len(losses))
        metrics["epochs"] = len(losses) / self.per_epoch

    def score(self) -> dict[str, float]:
        """The held-out quality now: accuracy, eval_loss and (language models) perplexity."""
        setup = self.setup
        scores = evaluate(
            setup.model, setup.task, self.data.test, setup.device,
            setup.precision.autocast, setup.prepare_batch, setup.micro_batch_size,
        )  # fmt: skip
        return with_perplexity(scores, self.language_model)

    def final_quality(self, train_s: float) -> dict[str, float]:
        """The quality after training; with ``eval_every`` also the curve's last point (one
        already taken at the last step is not taken again), where a target may be met too."""
        curve, step = self.curve, len(self.measured.loss_history)
        if curve is None:
            return self.score()
        if not curve.points or curve.points[-1].step != step:
            curve.run(step, train_s)
        return dict(curve.points[-1].metrics)

    def checkpoint(self) -> bool:
        """Evaluate if one is due at this step (``eval_every``); whether the target is met."""
        curve = self.curve
        if curve is None:
            return False
        step = len(self.measured.loss_history)
        if curve.due(step) and not curve.done:
            synchronize(self.setup.device)
            elapsed = time.perf_counter() - self.train_start - curve.spent_s
            curve.run(step, self.setup.ranks.maximum(elapsed))
        return curve.done

    def next_batch(self) -> Batch:
        return self.setup.to_device(next(self.stream))

    def warm_up(self, steps: int) -> None:
        for _ in range(steps):
            self.checkpoint()  # evaluations may run between warm-up steps (nothing is measured)
            self.record_loss(self.setup.train_step(self.next_batch()))

    def measure_memory(self, steps: int) -> None:
        setup, config, metrics = self.setup, self.setup.config, self.measured.metrics
        staged = [self.next_batch() for _ in range(steps)]
        writes = self.output_dir is not None and setup.ranks.is_writer
        snapshot = writes and config.allocator_snapshot
        window = MemoryWindow(
            setup.device,
            setup.model,
            setup.optimizer,
            [t for batch in staged for t in batch.values()],
            timeline=writes and config.timeline,
            allocator_snapshot=(
                str(self.output_dir / SNAPSHOT_FILE)
                if snapshot and self.output_dir is not None
                else None
            ),
        )
        if (slower := tracker.choice().why) is not None:  # its steps here ran slower
            self.measured.info["tracker"] = f"PyTorch's MemTracker as shipped: {slower}"
        try:
            with window:
                synchronize(setup.device)
                start = time.perf_counter()
                for batch in staged:
                    loss = setup.train_step(batch, on_micro_batch=window.micro_batch_done)
                    self.record_loss(loss)
                synchronize(setup.device)
                tracked_s = time.perf_counter() - start
        finally:  # an OOM in the window keeps the note too
            if window.snapshot_error:
                self.measured.info["allocator_snapshot"] = window.snapshot_error
        metrics["memory_step_time_ms"] = tracked_s / max(steps, 1) * 1000
        timeline = window.timeline(steps, setup.micro_batches)
        if timeline is not None and self.output_dir is not None:
            timeline["trial_key"] = config.trial_key
            (self.output_dir / TIMELINE_FILE).write_text(
                json.dumps(timeline, separators=(",", ":"))
            )
        del staged
        assert window.reading is not None
        own: dict[str, Any] = {**window.reading.metrics(), "peak_phase": window.reading.peak_phase}
        if self.measured.own_prediction is not None:
            own["predicted_peak_bytes"] = self.measured.own_prediction
        readings = setup.ranks.gather(own)
        reading = setup.ranks.worst_memory(readings)
        reading.pop("predicted_peak_bytes", None)
        phase = reading.pop("peak_phase", None)
        if phase:  # the worst rank's
            self.measured.info["peak_phase"] = phase
        metrics.update(reading)
        if setup.ranks.size > 1:
            peaks = [r["peak_allocated_bytes"] for r in readings]
            metrics["peak_rank"] = float(peaks.index(max(peaks)))
        if setup.ranks.size > 1:  # each rank's own: its peak, breakdown and prediction
            self.measured.info["rank_memory"] = json.dumps(
                setup.ranks.memory_by_rank(readings), separators=(",", ":")
            )
        if "predicted_peak_bytes" in metrics:
            metrics["prediction_ratio"] = (
                metrics["predicted_peak_bytes"] / reading["peak_allocated_bytes"]
            )
        for predicted, measured, ratio in (
            ("predicted_reserved_bytes", "peak_reserved_bytes", "reserved_prediction_ratio"),
            ("predicted_device_bytes", "peak_device_bytes", "device_prediction_ratio"),
        ):
            if metrics.get(predicted) and reading.get(measured):
                metrics[ratio] = metrics[predicted] / reading[measured]
        check_budget(reading, config.device_memory_bytes, self.measured.outside_bytes)

    def measure_speed(self, steps: int) -> None:
        setup = self.setup
        # The memory window leaves thousands of tracker objects behind; collected now, they
        # cannot trigger a full garbage collection in the middle of a timed step. (The
        # collector stays on while timing, as in any training loop.)
        gc.collect()
        staged = [self.next_batch() for _ in range(steps)]
        timer = StepTimer(setup.device)
        # Back to back, the device synchronised only around the window (harness.meters.timing);
        # the losses are read after it, since reading one would synchronise between steps.
        # What else ran on the cores meanwhile is read around exactly those steps.
        with ContentionMeter() as contention, EnergyMeter(setup.device) as energy:
            losses = timer.run(setup.train_step, staged)
        del staged
        speed = timer.metrics(setup.samples_per_step)
        self.measured.metrics.update(setup.ranks.combined_speed(speed))
        self.record_energy(energy, steps)
        if setup.ranks.size > 1:  # one more step, profiled: its time in collectives
            batch = self.next_batch()
            spent, loss = collective_ms(lambda: setup.train_step(batch), setup.device)
            self.measured.metrics["comm_time_ms"] = setup.ranks.maximum(spent)
            losses.append(loss)
        self.compare_speed()
        self.record_contention(contention.metrics())
        if self.output_dir is not None and setup.ranks.is_writer:
            self.write_step_times(timer)
        for loss in losses:
            self.record_loss(loss)

    def record_energy(self, meter: EnergyMeter, steps: int) -> None:
        """The GPUs' energy over the timed window, summed over ranks (``harness.meters.energy``);
        per training sample (a sequence, not a token) of the window."""
        assert meter.reading is not None
        setup = self.setup
        readings = setup.ranks.gather(meter.reading.as_dict())
        figures, text = combine(readings, setup.config.batch_size * steps)
        self.measured.metrics.update(figures)
        self.measured.info["energy_counter"] = text

    def compare_speed(self) -> None:
        """How right the predicted step time was, and the MFU the measured one makes: the
        same model FLOPs and peak as the prediction's MFU, over the measured time."""
        metrics = self.measured.metrics
        predicted, measured = metrics.get("predicted_step_time_ms"), metrics["step_time_ms_p50"]
        if predicted and measured > 0:
            metrics["step_time_ratio"] = predicted / measured
            metrics["mfu"] = metrics["predicted_mfu"] * predicted / measured

    def record_contention(self, figures: dict[str, float]) -> None:
        """The busiest rank's view of the timed window (``harness.meters.contention``): the
        most other work, steal and load, the fewest free cores (the other ranks of the trial
        count as other work: they compete for the same cores)."""
        readings = self.setup.ranks.gather(figures)
        for name in sorted({name for reading in readings for name in reading}):
            values = [reading[name] for reading in readings if name in reading]
            worst = min if name == "timing_free_cores" else max
            self.measured.metrics[name] = worst(values)

    def write_step_times(self, timer: StepTimer) -> None:
        """Rank 0's raw per-step times beside the result, for distributions the percentiles
        summarise (``step_times.json``)."""
        assert self.output_dir is not None
        setup = self.setup
        data = {
            **timer.artifact(),
            "trial_key": setup.config.trial_key,
            "samples_per_step": setup.samples_per_step,
            "rank": setup.ranks.rank,
            "world_size": setup.ranks.size,
        }
        (self.output_dir / STEP_TIMES_FILE).write_text(json.dumps(data, separators=(",", ":")))

    def train_rest(self, steps: int) -> None:
        """The remaining budget, batches moved at each step: what an epoch really takes. With a
        target, it ends at the evaluation that meets it."""
        device, curve = self.setup.device, self.curve
        synchronize(device)
        start = time.perf_counter()
        evaluated = 0.0 if curve is None else curve.spent_s
        taken = 0
        for _ in range(steps):
            if self.checkpoint():
                break
            self.record_loss(self.setup.train_step(self.next_batch()))
            taken += 1
        else:
            self.checkpoint()  # the last step's evaluation, where one is due
        synchronize(device)
        evaluated = 0.0 if curve is None else curve.spent_s - evaluated
        elapsed = self.setup.ranks.maximum(time.perf_counter() - start - evaluated)
        if taken:
            self.measured.metrics["epoch_time_s"] = elapsed / taken * self.per_epoch

    def record_loss(self, loss: torch.Tensor) -> None:
        value = self.setup.ranks.mean(loss.item())
        self.measured.loss_history.append(value)
        if not math.isfinite(value):
            step = len(self.measured.loss_history)
            raise TrialFailure(Status.DIVERGED, f"training loss became {value} at step {step}")


def check_budget(reading: dict[str, float], budget: int | None, outside: int = 0) -> None:
    """A peak over ``device_memory`` is what that card would do: ``oom``. Compared is the figure
    the card's cap applies to: on CUDA ``set_per_process_memory_fraction`` (``emulate_card``)
    caps the allocator's reservation, so reserved, beside what the planned card holds outside
    the allocator (``outside``: its context, NCCL); on CPU (no allocator counters) allocated."""
    if budget is None:
        return
    figure = "reserved" if "peak_reserved_bytes" in reading else "allocated"
    peak = reading[f"peak_{figure}_bytes"] + (outside if figure == "reserved" else 0)
    if peak > budget:
        beside = f" + {format_bytes(outside)} context" if outside and figure == "reserved" else ""
        raise TrialFailure(
            Status.OOM,
            f"peak {figure}{beside} {format_bytes(peak)} exceeds device_memory "
            f"{format_bytes(budget)}",
        )
