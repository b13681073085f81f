"""A sweep from spec to recorded results: plan the grid, launch each trial, record it, report.

Running the same spec again resumes its sweep: trials already recorded in MLflow are never run
again, and a trial interrupted by a killed sweep is run anew.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
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

from harness import search
from harness.launch import RETRYABLE, describe, launch_trial
from harness.spec import Spec
from harness.tracking import Tracker


@dataclass
class SweepOutcome:
    experiment: str
    parent_run_id: str
    total: int
    already_recorded: int


def trial_label(point: dict[str, Any]) -> str:
    return f"{point['model_size']} bs={point['batch_size']} {point['dtype']} {point['strategy']}"


def sweep_params(spec: Spec) -> dict[str, str]:
    axes = spec.axes()
    return {
        "model": spec.model.family,
        "dataset": spec.data.dataset,
        "n_trials": str(len(spec.points())),
        **{f"axis_{name}": ",".join(map(str, values)) for name, values in axes.items()},
        "budget": ",".join(f"{k}={v}" for k, v in spec.train.budget.as_dict().items()),
        "device": spec.device,
        "device_memory_bytes": str(spec.device_memory or ""),
        "search_method": spec.search.method,
        # What `harness pareto` compares by default, e.g. "peak_allocated_bytes:min,throughput:max".
        "objectives": ",".join(
            f"{o.metric}:{'max' if o.direction == 'maximize' else 'min'}"
            for o in spec.search.objectives
        ),
    }


def run_sweep(
    spec: Spec, console: Console, fresh: bool = False, more_trials: int | None = None
) -> SweepOutcome:
    results_dir = Path(spec.tracking.results_dir)
    experiment_dir = results_dir / spec.experiment
    study = search.open_study(spec, fresh=fresh)
    interrupted = search.fail_stale_trials(study)
    tracker = Tracker(
        spec.tracking.mlflow_uri, spec.experiment, results_dir / "mlartifacts" / spec.experiment
    )
    parent = tracker.open_sweep(
        None if fresh else study.user_attrs.get("mlflow_parent_run_id"),
        name=f"sweep {spec.experiment}",
        tags={
            "spec_name": spec.name,
            "grid_hash": spec.grid_hash(),
            "study_name": study.study_name,
        },
        params=sweep_params(spec),
    )
    study.set_user_attr("mlflow_parent_run_id", parent)
    if spec._source:
        tracker.client.log_artifact(parent, spec._source, artifact_path="spec")

    tracker.discard_unfinished_trials(parent)  # each also left a stale study trial, counted above
    recorded = set(tracker.recorded_trials(parent))
    to_run = search.trials_to_run(spec, len(recorded), more_trials)
    total = len(recorded) + to_run
    outcome = SweepOutcome(spec.experiment, parent, total, len(recorded))
    if outcome.already_recorded or interrupted:
        console.print(
            f"Resuming sweep {parent[:8]}: {outcome.already_recorded} of {total} trials already "
            f"recorded{f', {interrupted} interrupted trial(s) will re-run' if interrupted else ''}."
        )
    if not to_run:
        hint = (
            "Use --fresh to start a new sweep of this spec."
            if spec.search.method == "grid" or len(recorded) >= len(spec.points())
            else "Use --n-trials N to run N more, or --fresh to start a new sweep."
        )
        console.print(f"Nothing left to run. {hint}")
        tracker.close_sweep(parent, status_counts(tracker.recorded_trials(parent)))
        return outcome

    searched = (
        ""
        if spec.search.method == "grid"
        else f", chosen by Optuna's {spec.search.sampler} sampler from {len(spec.points())} points"
    )
    console.print(
        f"Sweep [bold]{spec.experiment}[/]: {to_run} trial(s) to run{searched}, each in its own "
        f"process (timeout {spec.limits.trial_timeout:g}s). MLflow: {spec.tracking.mlflow_uri}"
    )
    progress = Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
    )
    try:
        with progress:
            task = progress.add_task("starting", total=total, completed=outcome.already_recorded)
            plan = search.SearchPlan(study, spec, recorded, to_run)
            for index, (trial, point, config) in enumerate(plan, start=len(recorded) + 1):
                label = trial_label(point)
                progress.update(task, description=f"trial {index}/{total}: {label}")
                started_ms = int(time.time() * 1000)
                result = run_with_retries(
                    spec, config, experiment_dir / "trials" / config.trial_key
                )
                run_id = tracker.log_trial(
                    parent,
                    config,
                    result,
                    experiment_dir / "trials" / config.trial_key,
                    started_ms,
                    label,
                )
                search.tell(study, trial, spec, result, run_id)
                progress.console.print(
                    f"[{index}/{total}] {label:<28} {describe(result)}  "
                    f"[{result.get('wall_time_s', 0):.1f}s]",
                    soft_wrap=True,
                    markup=False,
                    highlight=False,
                )
                progress.advance(task)
    except KeyboardInterrupt:
        tracker.close_sweep(parent, {}, status="KILLED")
        raise
    tracker.close_sweep(parent, status_counts(tracker.recorded_trials(parent)))
    return outcome


def status_counts(recorded: dict[str, str]) -> dict[str, float]:
    """The parent run's ``trials_<status>`` metrics, over the whole sweep (resumes included)."""
    counts = Counter(recorded.values())
    return {f"trials_{status}": float(n) for status, n in counts.items()}


def run_with_retries(spec: Spec, config: Any, workdir: Path) -> dict[str, Any]:
    """Launch the trial; re-launch a crash or timeout up to ``limits.retries`` times."""
    for attempt in range(spec.limits.retries + 1):
        result = launch_trial(config, workdir, spec.limits.trial_timeout)
        result["attempts"] = attempt + 1
        if result["status"] not in RETRYABLE:
            break
    return result
