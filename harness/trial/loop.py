"""One trial, top to bottom: build, warm up, measure memory, time steps, train to budget, evaluate.

The phases are separate on purpose (design notes §4): the optimizer state exists only after the
first step, so memory is measured after warm-up; tensor accounting slows steps, so timing runs
in a window of its own. Every measured step is also a real training step and counts toward the
budget.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from harness.meters.host import peak_rss_bytes
from harness.meters.memory import MemoryWindow
from harness.meters.timing import StepTimer, synchronize
from harness.strategies import build_strategies
from harness.strategies.base import TrialContext
from harness.trial.config import SNAPSHOT_FILE, TIMELINE_FILE, TrialConfig
from harness.trial.distributed import Ranks
from harness.trial.modules import convert
from harness.trial.optim import build_optimizer
from harness.trial.outcome import Status, TrialFailure
from harness.trial.precision import Precision
from harness.units import format_bytes
from harness.workloads import build_model, load_dataset, resolve_knobs
from harness.workloads.tensors import DataInfo, SplitData, batches, steps_per_epoch

EVAL_BATCH = 512


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrialFailure(Status.CRASH, f"device {name!r} was asked for but CUDA is not available")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def emulate_card(device: torch.device, budget: int | None) -> None:
    """Cap this process at the planned card's size, so a too-big trial really OOMs (CUDA only)."""
    if device.type != "cuda" or budget is None:
        return
    total = torch.cuda.get_device_properties(device).total_memory
    if budget < total:
        torch.cuda.set_per_process_memory_fraction(budget / total, device)


class Trial:
    """Runs one ``TrialConfig`` and collects what it measured, even when it ends early."""

    def __init__(self, config: TrialConfig, output_dir: Path | None = None) -> None:
        self.config = config
        # Where the trial writes files beside its result (the memory timeline); None: nowhere.
        self.output_dir = output_dir
        self.metrics: dict[str, float] = {}
        self.loss_history: list[float] = []
        self.info: dict[str, Any] = {"torch_version": torch.__version__}
        self.steps_done = 0
        # Called after each micro-batch's backward; the memory window resets per-module stats.
        self.after_micro_batch: Callable[[], None] = lambda: None

    # ---- the phases -------------------------------------------------------------------------

    def run(self) -> None:
        cfg = self.config
        self.strategies = build_strategies(cfg.strategy)
        for strategy in self.strategies:  # allocator settings must precede the first CUDA call
            os.environ.update(strategy.environment())
        self.ranks = ranks = Ranks.from_env()
        target = resolve_device(cfg.device)
        # Before joining the process group: a multi-rank estimate runs on a fake group of its own.
        with self.clock("estimate_time_s"):
            self.predict(target)
        self.device = device = ranks.start(target)
        self.info.update(
            device=str(device),
            device_name=device_name(device),
            torch_threads=torch.get_num_threads(),
        )
        emulate_card(device, cfg.device_memory_bytes)
        seed_everything(cfg.seed)
        with self.clock("setup_time_s"):
            data = load_dataset(cfg.dataset, self.data_options(), cfg.seed)
            self.build(data.info, data)
        per_epoch = steps_per_epoch(len(data.train_x), cfg.batch_size)
        budget_steps = cfg.budget.get("steps") or cfg.budget.get("epochs", 1) * per_epoch
        measured = cfg.warmup_steps + cfg.memory_steps + cfg.timed_steps
        total_steps = max(budget_steps, measured)
        stream = batches(data.train_x, data.train_y, cfg.batch_size, cfg.seed)

        with self.clock("train_time_s"):
            self.warm_up(stream, cfg.warmup_steps)
            self.measure_memory(stream, cfg.memory_steps)
            self.measure_speed(stream, cfg.timed_steps)
            self.train_rest(stream, total_steps - measured, per_epoch)
        with self.clock("eval_time_s"):
            # Every rank evaluates the whole held-out split (sharded models need all ranks in
            # each forward); the results agree, rank 0 reports them.
            self.metrics.update(
                evaluate(self.model, data, device, self.precision, self.prepare_batch)
            )
            for strategy in self.strategies:
                self.metrics.update(strategy.after_training(self.model, self.ctx))
        window = self.loss_history[-per_epoch:]
        self.metrics["train_loss"] = sum(window) / len(window)
        self.metrics["train_steps"] = float(self.steps_done)
        self.metrics["epochs"] = self.steps_done / per_epoch

    @contextlib.contextmanager
    def clock(self, metric: str) -> Iterator[None]:
        """Wall time of one phase, so a sweep's own overhead can be told from training time."""
        synchronize(getattr(self, "device", torch.device("cpu")))
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(getattr(self, "device", torch.device("cpu")))
            self.metrics[metric] = time.perf_counter() - start

    def data_options(self) -> dict[str, Any]:
        options = dict(self.config.data_options)
        knobs = resolve_knobs(self.config.model_family, self.config.model_knobs)
        if "seq_len" in knobs:  # a sequence model sets the length of its text windows
            options.setdefault("seq_len", knobs["seq_len"])
        return options

    def build(self, info: DataInfo, data: SplitData | None) -> None:
        """Model, strategies and optimizer on ``self.device``: shared by training and estimating."""
        cfg, device = self.config, self.device
        self.precision = Precision(cfg.dtype, device, scaler=data is not None)
        self.ctx = ctx = TrialContext(device, cfg.dtype, cfg.model_family, data, cfg.batch_size)
        if data is not None:
            ctx.evaluate = lambda model, on=device: evaluate(
                model, data, on, self.precision, self.prepare_batch
            )
        knobs = resolve_knobs(cfg.model_family, cfg.model_knobs)
        model = convert(build_model(cfg.model_family, knobs, info, cfg.python_path), device)
        for strategy in self.strategies:
            model = strategy.prepare_model(model, ctx)
        self.info.update(ctx.notes)  # what strategies did (segments, pruned parameters, ...)
        self.model = model
        optimizer_spec = dict(cfg.optimizer)
        for strategy in self.strategies:
            optimizer_spec = strategy.optimizer(optimizer_spec, ctx)
        self.optimizer = build_optimizer(
            optimizer_spec, [p for p in model.parameters() if p.requires_grad]
        )
        self.micro_batches = math.prod(s.micro_batches() for s in self.strategies)
        self.set_to_none = all(s.zero_grad_set_to_none() for s in self.strategies)
        self.info["optimizer"] = optimizer_spec["name"]
        self.metrics["num_params"] = float(
            sum(p.numel() for p in model.parameters() if p.requires_grad)
        )
        self.samples_per_step = cfg.batch_size // self.ranks.size * info.tokens_per_sample
        self.info["throughput_unit"] = "tokens/s" if info.tokens_per_sample > 1 else "samples/s"
        self.info["world_size"] = self.ranks.size

    def predict(self, device: torch.device) -> None:
        """Predict the peak before training; a trial that cannot fit is not run (``infeasible``)."""
        from harness.trial.estimate import estimate_peak, host_guard

        prediction = estimate_peak(self.config, device)
        if "unpredictable" in prediction:
            self.info["prediction"] = prediction["unpredictable"]
            return
        self.metrics["predicted_peak_bytes"] = prediction["predicted_peak_bytes"]
        budget = self.config.device_memory_bytes
        peak = prediction["predicted_peak_bytes"]
        if budget is not None and peak > budget and not self.config.run_infeasible:
            raise TrialFailure(
                Status.INFEASIBLE,
                f"predicted peak {format_bytes(peak)} exceeds device_memory {format_bytes(budget)}",
            )
        reason = host_guard(peak, device)
        if reason and not self.config.run_infeasible:
            raise TrialFailure(Status.INFEASIBLE, reason)

    def warm_up(self, stream: Iterator[Any], steps: int) -> None:
        for _ in range(steps):
            self.record_loss(self.train_step(*self.to_device(next(stream))))

    def measure_memory(self, stream: Iterator[Any], steps: int) -> None:
        staged = [self.to_device(next(stream)) for _ in range(steps)]
        record = self.config.timeline and self.output_dir is not None and self.ranks.is_writer
        window = MemoryWindow(
            self.device,
            self.model,
            self.optimizer,
            [t for b in staged for t in b],
            timeline=record,
            allocator_snapshot=str(self.output_dir / SNAPSHOT_FILE) if record else None,
        )
        self.after_micro_batch = window.step_done
        with window:
            synchronize(self.device)
            start = time.perf_counter()
            for batch in staged:
                self.record_loss(self.train_step(*batch))
            synchronize(self.device)
            tracked_s = time.perf_counter() - start
        self.after_micro_batch = lambda: None
        self.metrics["memory_step_time_ms"] = tracked_s / max(steps, 1) * 1000
        timeline = window.timeline(steps, self.micro_batches)
        if timeline is not None and self.output_dir is not None:
            timeline["trial_key"] = self.config.trial_key
            (self.output_dir / TIMELINE_FILE).write_text(
                json.dumps(timeline, separators=(",", ":"))
            )
        del staged
        assert window.reading is not None
        reading = self.ranks.worst_memory(window.reading.metrics())
        self.metrics.update(reading)
        if "predicted_peak_bytes" in self.metrics:
            ratio = self.metrics["predicted_peak_bytes"] / reading["peak_allocated_bytes"]
            self.metrics["prediction_ratio"] = ratio
        peak, budget = reading["peak_allocated_bytes"], self.config.device_memory_bytes
        if budget is not None and peak > budget:
            raise TrialFailure(
                Status.OOM,
                f"peak allocated {format_bytes(peak)} exceeds device_memory {format_bytes(budget)}",
            )

    def measure_speed(self, stream: Iterator[Any], steps: int) -> None:
        # The memory window leaves thousands of tracker objects behind; collected now, they
        # cannot trigger a full garbage collection in the middle of a timed step. (The
        # collector stays on while timing, as in any training loop.)
        gc.collect()
        staged = [self.to_device(next(stream)) for _ in range(steps)]
        timer = StepTimer(self.device)
        for x, y in staged:
            loss = timer.time(lambda x=x, y=y: self.train_step(x, y))
            self.record_loss(loss)
        self.metrics.update(self.ranks.combined_speed(timer.metrics(self.samples_per_step)))

    def train_rest(self, stream: Iterator[Any], steps: int, per_epoch: int) -> None:
        if steps <= 0:
            return
        synchronize(self.device)
        start = time.perf_counter()
        for _ in range(steps):
            self.record_loss(self.train_step(*self.to_device(next(stream))))
        synchronize(self.device)
        elapsed = self.ranks.maximum(time.perf_counter() - start)
        self.metrics["epoch_time_s"] = elapsed / steps * per_epoch

    # ---- one step -----------------------------------------------------------------------------

    def prepare_batch(self, x: torch.Tensor) -> torch.Tensor:
        for strategy in self.strategies:
            x = strategy.prepare_batch(x)
        return x

    def to_device(
        self, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = (self.ranks.shard(t).to(self.device, non_blocking=True) for t in batch)
        return self.prepare_batch(x), y

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=self.set_to_none)
        total = torch.zeros((), device=self.device)
        for x_part, y_part in zip(
            x.chunk(self.micro_batches), y.chunk(self.micro_batches), strict=True
        ):
            with contextlib.ExitStack() as stack:
                for strategy in self.strategies:
                    stack.enter_context(strategy.step_context())
                with self.precision.autocast():
                    loss = cross_entropy(self.model(x_part), y_part) / self.micro_batches
                self.precision.backward(loss)
            self.after_micro_batch()
            total += loss.detach().float()
        self.precision.step(self.optimizer)
        return total

    def record_loss(self, loss: torch.Tensor) -> None:
        value = self.ranks.mean(loss.item())
        self.steps_done += 1
        self.loss_history.append(value)
        if not math.isfinite(value):
            raise TrialFailure(
                Status.DIVERGED, f"training loss became {value} at step {self.steps_done}"
            )

    # ---- the result ---------------------------------------------------------------------------

    def result(self, status: Status, reason: str = "") -> dict[str, Any]:
        rss = peak_rss_bytes()
        ranks = getattr(self, "ranks", None)
        if ranks is not None:  # the worst rank's host memory; then leave the process group
            rss = ranks.maximum(rss)
            ranks.stop()
        self.metrics["peak_rss_bytes"] = float(rss)
        return {
            "trial_key": self.config.trial_key,
            "status": status.value,
            "failure_reason": reason,
            "metrics": {k: v for k, v in self.metrics.items() if math.isfinite(v)},
            "loss_history": self.loss_history,
            "info": self.info,
        }


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Classification ([B, C] vs [B]) and next-token ([B, T, V] vs [B, T]) alike, in fp32."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction=reduction)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    data: SplitData,
    device: torch.device,
    precision: Precision,
    prepare_batch: Any = lambda x: x,
) -> dict[str, float]:
    """Held-out accuracy (per token for sequence models) and mean cross-entropy."""
    was_training = model.training
    model.eval()
    correct, loss_sum, count = 0, 0.0, 0
    for start in range(0, len(data.test_x), EVAL_BATCH):
        x = prepare_batch(data.test_x[start : start + EVAL_BATCH].to(device))
        y = data.test_y[start : start + EVAL_BATCH].to(device)
        with precision.autocast():
            logits = model(x)
        loss_sum += cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(dim=-1) == y).sum().item()
        count += y.numel()
    model.train(was_training)
    return {"accuracy": correct / count, "eval_loss": loss_sum / count}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def run_trial(config: TrialConfig, output_dir: Path | None = None) -> dict[str, Any]:
    """Run one trial in this process and return its plain-JSON result (and, in ``output_dir``,
    its memory timeline).

    Ends with ``ok``, or ``oom``/``diverged`` (measurements so far kept). Any other exception
    propagates: the worker entry point records it as ``crash``.
    """
    trial = Trial(config, output_dir)
    try:
        trial.run()
    except TrialFailure as failure:
        return trial.result(failure.status, failure.reason)
    except torch.OutOfMemoryError as error:
        trial.__dict__.pop("model", None)
        trial.__dict__.pop("optimizer", None)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else "out of memory"
        return trial.result(Status.OOM, first_line)
    except RuntimeError as error:
        # The CPU allocator's refusal is an allocation failure like CUDA's, not a crash.
        if "can't allocate memory" not in str(error):
            raise
        trial.__dict__.pop("model", None)
        trial.__dict__.pop("optimizer", None)
        return trial.result(Status.OOM, str(error).strip().splitlines()[0][:300])
    return trial.result(Status.OK)
