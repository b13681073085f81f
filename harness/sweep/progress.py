"""What a sweep says: the lines before trials start, its progress display, one line per trial.

``--workers N`` shows one display for all its workers: a managed worker writes its lines behind
``TRIAL_LINE``/``NOISE_LINE`` and the sweep's process shows them (``harness.sweep.workers``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from harness.analyse.noise import NOISY_MARK, noise_reason
from harness.record.stores import redact
from harness.spec import SweepPlan
from harness.spec.schema import MAX_BATCH
from harness.sweep import plan
from harness.sweep.prepare import SweepState
from harness.trial.config import TrialConfig
from harness.trial.hardware import describe_hardware
from harness.trial.result import TrialResult
from harness.units import format_bytes, format_quantity


def trial_label(point: dict[str, Any], config: TrialConfig | None = None) -> str:
    batch = point["batch_size"]
    if batch == MAX_BATCH and config is not None:
        batch = f"{MAX_BATCH}:{config.batch_size}"  # what trains, and that it was searched
    return f"{point['model_size']} bs={batch} {point['dtype']} {point['strategy']}"


def describe(result: TrialResult) -> str:
    """A short human summary of a result for progress lines."""
    metrics = result.metrics
    parts = [result.status.value]
    if "peak_allocated_bytes" in metrics:  # as every table shows them (harness.cli.common.cell)
        parts.append(f"peak {format_bytes(metrics['peak_allocated_bytes'], short=True)}")
    if "throughput" in metrics:
        unit = result.info.get("throughput_unit", "samples/s")
        noisy = noise_reason({**result.metrics, **result.info})
        parts.append(format_quantity(metrics["throughput"], unit) + (NOISY_MARK if noisy else ""))
    if "accuracy" in metrics:
        parts.append(f"acc {format_quantity(metrics['accuracy'])}")
    if result.failure_reason:
        parts.append(f"({result.failure_reason})")
    return "  ".join(parts)


def announce(state: SweepState, console: Console) -> None:
    """One line each for what a user must know before trials start: the spec was swept on
    other hardware (so this is a new sweep), trials superseded for a retry."""
    if state.other_hardware:
        console.print(
            f"This spec was swept on {state.other_hardware}; this host runs "
            f"{describe_hardware(dict(state.plan.hardware or {}))}: starting a new sweep (hardware is part "
            "of a trial's identity; the earlier results stay in MLflow).",
            soft_wrap=True,
        )
    if state.restored or state.study_named is not None:
        storage = redact(state.spec.tracking.storage)
        named = f"sweep run {state.study_named[:8]}" if state.study_named else "no sweep run"
        console.print(
            f"{state.restored} recorded trial(s) of this sweep were missing from the study in "
            f"{storage} (its storage was switched, emptied or lost): copied back from MLflow "
            f"(sweep run {state.parent[:8]}); they will not run again."
            if state.restored
            else f"Resuming sweep run {state.parent[:8]} as MLflow records it (the study in "
            f"{storage} named {named}).",
            soft_wrap=True,
            markup=False,
            highlight=False,
        )
    if state.retried:
        console.print(
            f"Retrying {state.retried} recorded trial(s): their runs are marked superseded "
            "(deleted in MLflow, restorable) and they run again in this sweep.",
            soft_wrap=True,
        )
    for line in max_batch_lines(state.plan):
        console.print(line, soft_wrap=True, markup=False, highlight=False)


def max_batch_lines(sweep: SweepPlan) -> list[str]:
    """What ``grid.batch_size: max`` resolved to, one line per configuration."""
    return [
        f"{size} {dtype} {strategy}: batch_size {entry['search']}"
        for (size, dtype, strategy), entry in sweep.max_batch.items()
    ]


@dataclass
class Start:
    """What a sweep has left when it starts: what is recorded, how many trials to run."""

    recorded: set[str]
    to_run: int
    total: int


def start(state: SweepState, console: Console, more_trials: int | None = None) -> Start:
    """Count what is recorded and what is left, and say so: resuming, nothing left, or how
    many trials run (one of these lines per sweep, whoever runs its trials)."""
    spec, parent, size = state.spec, state.parent, len(state.plan.points)
    left = left_to_run(state, more_trials)
    recorded, to_run, total = left.recorded, left.to_run, left.total
    interrupted = state.interrupted
    if recorded or interrupted:
        console.print(
            f"Resuming sweep {parent[:8]}: {len(recorded)} of {total} trials already "
            f"recorded{f', {interrupted} interrupted trial(s) will re-run' if interrupted else ''}."
        )
    if not to_run:
        hint = (
            "Use --fresh to start a new sweep of this spec."
            if spec.search.method == "grid" or len(recorded) >= size
            else "Use --n-trials N to run N more, or --fresh to start a new sweep."
        )
        console.print(f"Nothing left to run. {hint}")
        return left
    searched = (
        ""
        if spec.search.method == "grid"
        else f", chosen by Optuna's {spec.search.sampler} sampler from {size} points"
    )
    console.print(
        f"Sweep [bold]{spec.experiment}[/]: {to_run} trial(s) to run{searched}, each in its own "
        f"process (timeout {spec.limits.trial_timeout:g}s). "
        f"MLflow: {redact(spec.tracking.mlflow_uri)}",
        soft_wrap=True,
    )
    return left


def left_to_run(state: SweepState, more_trials: int | None = None) -> Start:
    recorded = set(state.tracker.recorded_trials(state.parent))
    to_run = plan.trials_to_run(state.plan, len(recorded), more_trials)
    return Start(recorded, to_run, len(recorded) + to_run)


def progress_bar(console: Console, disable: bool = False) -> Progress:
    """The one progress display of a sweep (``--workers N`` too: ``harness.sweep.workers``)."""
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        disable=disable,
    )


# A worker started by ``harness sweep --workers N`` (``MANAGED_WORKER_ENV`` set) prints no
# header or progress bar of its own: it writes one line per finished trial behind
# ``TRIAL_LINE``, and its noise warning behind ``NOISE_LINE``, and the sweep's process shows
# them under its one progress display.
TRIAL_LINE = "trial\t"
NOISE_LINE = "noise\t"


def noise_warning(label: str, reason: str) -> str:
    """The sweep's one warning about noisy throughput (later noisy trials carry only ``~``)."""
    return (
        f"throughput of {label} is noisy ({reason}); it and any later noisy figure are marked "
        f"{NOISY_MARK}: compare them only with care (docs/measuring.md#stable-cpu-timings)"
    )
