"""A sweep from spec to recorded results: plan the grid, launch each trial, record it, report.

Running the same spec again resumes its sweep: trials already recorded in MLflow are never run
again, and a trial interrupted by a killed sweep is run anew.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
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
from harness.record.tracking import FRESH_TAG, STUDY_TAG, Tracker
from harness.spec import (
    Spec,
    SpecError,
    grid_hash,
    load_spec,
    on_hardware,
    points,
    trial_config,
)
from harness.spec.grid import max_batch_key, with_max_batch
from harness.spec.schema import MAX_BATCH
from harness.sweep import claim, plan, preflight
from harness.sweep.launch import launch_trial, start_warm_starter
from harness.trial.config import TIMELINE_FILE, TIMELINE_PNG, TrialConfig
from harness.trial.hardware import describe_hardware, host_hardware
from harness.trial.result import OVER_BUDGET, RETRYABLE, Status, TrialResult
from harness.units import format_bytes, format_quantity


@dataclass
class SweepOutcome:
    experiment: str
    parent_run_id: str
    total: int
    already_recorded: int


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


def sweep_params(spec: Spec) -> dict[str, str]:
    axes = spec.axes()
    return {
        "model": spec.model.family,
        "dataset": spec.data.dataset,
        "n_trials": str(len(points(spec))),
        **{f"axis_{name}": ",".join(map(str, values)) for name, values in axes.items()},
        "budget": ",".join(f"{k}={v}" for k, v in spec.train.budget.as_dict().items()),
        "device": spec.device,
        "device_memory_bytes": str(spec.memory_budget or ""),
        "search_method": spec.search.method,
        # What `harness pareto` compares by default, e.g. "peak_allocated_bytes:min,throughput:max".
        "objectives": ",".join(str(o.objective()) for o in spec.search.objectives),
    }


# ``--retry-failed``: which statuses each choice runs again.
RETRY_STATUSES: dict[str, tuple[Status, ...]] = {
    "failed": RETRYABLE,
    "all": (*RETRYABLE, *OVER_BUDGET, Status.DIVERGED),
}


@dataclass
class SweepState:
    """What every worker of one sweep shares: the study, the MLflow parent run, the spec."""

    spec: Spec
    study: Any
    tracker: Tracker
    parent: str
    interrupted: int
    retried: int = 0
    # Set when this spec was swept before on other hardware: what that was.
    other_hardware: str | None = None
    # Recorded trials the study did not hold, copied into it from MLflow (lost, emptied or
    # switched storage), and why the parent run is not the one the study named.
    restored: int = 0
    study_named: str | None = None  # "" when it named none


def prepare(
    spec: Spec,
    fresh: bool = False,
    worker: bool = False,
    runs_trials: bool = True,
    retry: str | None = None,
    launch: str | None = None,
) -> SweepState:
    """Open (or start) the sweep's study and MLflow parent run; fail dead workers' trials.

    The spec is first tied to this host's hardware (``harness.trial.hardware``): the resolved
    device and its name are part of every trial's identity, so the same spec on other hardware
    is another sweep. A ``worker`` joins a sweep that others may be running: it neither starts
    afresh nor deletes half-written trial runs (those may be another worker's, being written
    right now). Where this process ``runs_trials``, the warm trial starter imports torch
    meanwhile. ``retry`` (``failed`` or ``all``) frees the points of recorded trials with those
    statuses (``RETRY_STATUSES``) so they run again under the same parent run. ``launch``
    (a ``--launcher`` submission's id) is noted on the study, so ``harness sweep --wait`` finds
    the study its workers chose (their hardware names it).
    """
    preflight.check_stores(spec)  # before anything is created or any trial runs
    if runs_trials:
        preflight.check_device(spec)
    spec = on_hardware(spec, host_hardware(spec.device))
    if runs_trials:
        start_warm_starter()
    spec = resolve_max_batch(spec)  # before hashing: the found batches are in the trial keys
    results_dir = Path(spec.tracking.results_dir)
    study = plan.open_study(spec, fresh=fresh)
    other_hardware = plan.swept_elsewhere(study, spec)
    interrupted = claim.fail_stale_trials(study)
    if launch:
        study.set_user_attr(f"{LAUNCH_ATTR}{launch}", time.time())
    tracker = Tracker(
        spec.tracking.mlflow_uri, spec.experiment, results_dir / "mlartifacts" / spec.experiment
    )
    named = None if fresh else study.user_attrs.get("mlflow_parent_run_id")
    # The sweep is what MLflow recorded for this identity, whatever the study (lost, emptied,
    # another storage) remembers: recorded trials are never run again.
    known = None if fresh else tracker.settled_sweep(study.study_name, prefer=named)
    parent = tracker.open_sweep(
        known,
        name=f"sweep {spec.experiment}",
        tags={
            "spec_name": spec.name,
            "grid_hash": grid_hash(spec),
            STUDY_TAG: study.study_name,
            **hardware_tags(spec),
            **({FRESH_TAG: "true"} if fresh else {}),
        },
        params=sweep_params(spec),
    )
    if parent != named:
        study.set_user_attr("mlflow_parent_run_id", parent)
        if worker:  # two first workers may race: both settle on the last parent written
            time.sleep(1.0)
            settled = study.user_attrs.get("mlflow_parent_run_id", parent)
            if settled != parent:
                tracker.client.delete_run(parent)
                parent = settled
        if spec._source and parent == study.user_attrs.get("mlflow_parent_run_id"):
            log_spec(tracker, parent, Path(spec._source))
    retried, restored = 0, 0
    if not worker:
        runs = tracker.trial_runs(parent)  # read once for both
        tracker.discard_unfinished(runs)  # each also left a stale study trial
        # (workers leave it to the process that prepared the sweep: two copying at once
        # would teach the sampler every trial twice)
        restored = plan.restore_trials(study, spec, runs)
        if retry:
            statuses = {status.value for status in RETRY_STATUSES[retry]}
            keys = tracker.supersede_trials(parent, statuses)
            retried = plan.free_points(study, spec, keys)
    adopted = known and known != named  # the study named another run, or none
    study_named = (named or "") if adopted else None
    return SweepState(
        spec, study, tracker, parent, interrupted, retried, other_hardware, restored, study_named
    )


# On the study: ``launch_<id>`` for each ``--launcher`` submission whose workers joined it.
LAUNCH_ATTR = "launch_"


def run_worker(
    spec_path: str | Path,
    console: Console,
    storage: str | None = None,
    tracking_uri: str | None = None,
    launch: str | None = None,
    managed: bool = False,
) -> SweepOutcome:
    """``harness worker`` (also each Slurm job and Ray actor of ``--launcher``): join the
    sweep of the spec at ``spec_path`` from this process and run trials until none is left.
    ``storage``/``tracking_uri`` replace the spec's stores (they come from the environment,
    ``HARNESS_STORAGE``/``HARNESS_TRACKING_URI``, never a command line). ``managed``: one of
    the workers of ``harness sweep --workers N`` (``work``)."""
    spec = with_tracking(load_spec(spec_path), storage=storage, mlflow_uri=tracking_uri)
    state = prepare(spec, worker=True, launch=launch)
    return work(state, console, shuffle=True, managed=managed)


def resolve_max_batch(spec: Spec, target: str | None = None) -> Spec:
    """``grid.batch_size: max``: for each model size x dtype x strategy, the largest batch whose
    predicted peak fits ``device_memory`` (``harness.sweep.fit``: the estimator at a few batch
    sizes, in a child process), kept on the spec (``Spec._max_batch``) for ``trial_config``.

    ``target`` is the device type predicted for (default: the hardware the spec is tied to,
    ``on_hardware``). Where not even the smallest allowed batch fits (or the estimator cannot
    predict) that smallest batch stands in: the trial's own prediction then records it
    ``infeasible`` (or runs it). A spec without ``max``, or already resolved, is returned as is.
    """
    if MAX_BATCH not in spec.grid.batch_size or spec._max_batch:
        return spec
    from harness.sweep.estimate import EstimateError
    from harness.sweep.fit import default_jobs, fit_configs, upper_bound

    target = (target or (spec._hardware or {}).get("device") or spec.device).split(":")[0]
    budget = int(spec.memory_budget or 0)
    keys = list(itertools.product(spec.model.sizes, spec.grid.dtype, spec.grid.strategy))
    points_at_step = [  # at the smallest allowed batch; the search sets its own
        {"model_size": m, "batch_size": g.batch_step, "dtype": d, "strategy": g.text}
        for m, d, g in keys
    ]
    configs = [trial_config(spec, point) for point in points_at_step]
    print(
        f"grid.batch_size max: finding the largest batch within {format_bytes(budget)} for "
        f"{len(configs)} configuration(s), predicted on {target} ...",
        file=sys.stderr,
        flush=True,
    )
    try:
        answers = fit_configs(configs, target, [budget], "batch_size", None, default_jobs())
    except EstimateError as error:
        raise SpecError(f"{spec._source or '<spec>'}: grid.batch_size: max: {error}") from None
    found = {}
    for point, config, answer in zip(points_at_step, configs, answers, strict=True):
        bound = upper_bound(config, "batch_size", None)
        found[max_batch_key(point)] = max_batch_entry(
            answer["rows"][0], config.batch_size, budget, bound
        )
    return with_max_batch(spec, found)


def max_batch_entry(row: dict[str, Any], step: int, budget: int, bound: int) -> dict[str, Any]:
    """One configuration's resolved ``max``: the batch it trains at and how it was found (the
    trial's ``batch_size_search`` tag), e.g. ``max within 16.00 GiB: 142 (model, 4 predictions)``."""
    within = f"{MAX_BATCH} within {format_bytes(budget)}"
    value, count = row.get("value"), row.get("predictions")
    if value is None:  # refused or unpredictable at any batch
        why = row.get("refused") or row.get("unpredictable") or "no prediction"
        search = f"{within}: not predicted ({why}); the smallest allowed batch {step}"
        return {"batch_size": step, "search": search, "method": "not predicted"}
    if not value:
        search = f"{within}: none fits, the smallest allowed batch {step} ({count} predictions)"
        return {"batch_size": step, "search": search, "method": "none"}
    capped = ", the largest tried" if value + step > bound else ""
    search = f"{within}: {value} ({row.get('method')}, {count} predictions{capped})"
    return {
        "batch_size": int(value),
        "search": search,
        "method": row.get("method"),
        "predicted_peak_bytes": row.get("predicted_peak_bytes"),
    }


def log_spec(tracker: Tracker, parent: str, source: Path) -> None:
    """The spec file on the parent run, every password in its URLs replaced by ``***``."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        copy = Path(folder) / source.name
        copy.write_text(redact(source.read_text()))
        tracker.client.log_artifact(parent, str(copy), artifact_path="spec")


def hardware_tags(spec: Spec) -> dict[str, str]:
    """The parent run's ``device`` and ``device_name`` tags: what its trials ran on."""
    return {key: str(value) for key, value in (spec._hardware or {}).items()}


def run_sweep(
    spec: Spec,
    console: Console,
    fresh: bool = False,
    more_trials: int | None = None,
    retry: str | None = None,
) -> SweepOutcome:
    """The whole sweep in this process (``--workers N``: ``harness.sweep.workers``)."""
    state = prepare(spec, fresh=fresh, retry=retry)
    announce(state, console)
    return work(state, console, more_trials)


def announce(state: SweepState, console: Console) -> None:
    """One line each for what a user must know before trials start: the spec was swept on
    other hardware (so this is a new sweep), trials superseded for a retry."""
    if state.other_hardware:
        console.print(
            f"This spec was swept on {state.other_hardware}; this host runs "
            f"{describe_hardware(state.spec._hardware or {})}: starting a new sweep (hardware is part "
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
    for line in max_batch_lines(state.spec):
        console.print(line, soft_wrap=True, markup=False, highlight=False)


def max_batch_lines(spec: Spec) -> list[str]:
    """What ``grid.batch_size: max`` resolved to, one line per configuration."""
    return [
        f"{size} {dtype} {strategy}: batch_size {entry['search']}"
        for (size, dtype, strategy), entry in spec._max_batch.items()
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
    spec, parent = state.spec, state.parent
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
            if spec.search.method == "grid" or len(recorded) >= len(points(spec))
            else "Use --n-trials N to run N more, or --fresh to start a new sweep."
        )
        console.print(f"Nothing left to run. {hint}")
        return left
    searched = (
        ""
        if spec.search.method == "grid"
        else f", chosen by Optuna's {spec.search.sampler} sampler from {len(points(spec))} points"
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
    to_run = plan.trials_to_run(state.spec, len(recorded), more_trials)
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


def work(
    state: SweepState,
    console: Console,
    more_trials: int | None = None,
    shuffle: bool = False,
    managed: bool = False,
) -> SweepOutcome:
    """Run trials of the sweep until none is left for this worker; record each at once.

    Ends when every point is taken and no other worker is still running one; while others
    run, it waits and takes over the points of any that die (``harness.sweep.claim``).
    ``managed``: a worker of ``--workers N``, whose sweep process shows the progress.
    """
    spec, study, tracker, parent = state.spec, state.study, state.tracker, state.parent
    experiment_dir = Path(spec.tracking.results_dir) / spec.experiment
    left = left_to_run(state, more_trials) if managed else start(state, console, more_trials)
    recorded, total = left.recorded, left.total
    outcome = SweepOutcome(spec.experiment, parent, total, len(recorded))

    def close(status: str = "FINISHED") -> None:
        """The parent run's status and counts; the sweep's own process closes a managed
        worker's sweep once all its workers are done."""
        if not managed:
            counts = status_counts(tracker.recorded_trials(parent)) if status == "FINISHED" else {}
            tracker.close_sweep(parent, counts, status=status)

    if not left.to_run:
        close()
        return outcome

    def say(line: str, style: str = "", relay: str = TRIAL_LINE) -> None:
        if managed:
            print(f"{relay}{line}", flush=True)
        else:
            styled = f"[{style}]{escape(line)}[/]" if style else line
            progress.console.print(styled, soft_wrap=True, markup=bool(style), highlight=False)

    warned_noise = False
    progress = progress_bar(console, disable=managed)
    try:
        with progress:
            task = progress.add_task("starting", total=total, completed=outcome.already_recorded)
            index = len(recorded)
            while True:
                proposals = plan.SearchPlan(study, spec, recorded, total, shuffle)
                for trial, point, config in proposals:
                    index += 1
                    label = trial_label(point, config)
                    progress.update(task, description=f"trial {index}/{total}: {label}")
                    started_ms = int(time.time() * 1000)
                    workdir = experiment_dir / "trials" / config.trial_key
                    # The heartbeat covers the whole trial: drawing and recording can take
                    # long on a slow store, and a lapse would hand the point to another worker.
                    with claim.heartbeat(trial):
                        result = run_with_retries(spec, config, workdir)
                        problem = draw_timeline(workdir, label)
                        if problem:
                            say(problem, "yellow", relay="")
                        info = {k: result.info.get(k) for k in ("torch_threads", "device")}
                        noisy = noise_reason({**result.metrics, **info})
                        if noisy and not warned_noise:
                            say(noise_warning(label, noisy), "yellow", relay=NOISE_LINE)
                            warned_noise = True
                        if claim.cut_off_before(study, trial, config.trial_key):
                            # its dead worker may have left a half-written run of this point
                            tracker.discard_unfinished_trials(parent, config.trial_key)
                        run_id = tracker.log_trial(
                            parent, config, result, workdir, started_ms, label
                        )
                        plan.tell(study, trial, spec, result, run_id)
                    numbered = "" if managed else f"[{index}/{total}] "
                    say(
                        f"{numbered}{label:<28} {config.trial_key[:8]}  {describe(result)}  "
                        f"[{result.wall_time_s or 0:.1f}s]"
                    )
                    progress.update(task, completed=min(total, len(plan.active_keys(study))))
                if not plan.held_by_others(study):
                    break
                # Others are still running points of this sweep: wait, and take over any
                # whose worker died.
                time.sleep(claim.HEARTBEAT_S)
                claim.fail_stale_trials(study)
    except KeyboardInterrupt:
        close("KILLED")
        raise
    close()
    return outcome


def draw_timeline(workdir: Path, label: str) -> str | None:
    """Draw the trial's memory timeline beside its JSON, so both are logged with the trial.
    Returns what went wrong instead of raising: a picture must never cost a recorded trial."""
    source = workdir / TIMELINE_FILE
    if not source.exists():
        return None
    try:
        from harness.analyse import timelines

        data = json.loads(source.read_text())
        timelines.timeline_png([(label, data)], workdir / TIMELINE_PNG, f"memory timeline: {label}")
    except Exception as error:  # a damaged file or a plotting failure: report, go on
        return f"memory timeline of {label} not drawn: {type(error).__name__}: {error}"
    return None


def with_tracking(spec: Spec, **changes: str | None) -> Spec:
    """The spec with ``tracking`` keys replaced (``storage``, ``mlflow_uri``), source kept."""
    updates = {key: value for key, value in changes.items() if value is not None}
    if not updates:
        return spec
    copy = spec.model_copy(update={"tracking": spec.tracking.model_copy(update=updates)})
    copy._source = spec._source
    return copy


def status_counts(recorded: dict[str, str]) -> dict[str, float]:
    """The parent run's ``trials_<status>`` metrics, over the whole sweep (resumes included);
    every status has one, zero too, so a retried crash no longer counts."""
    counts = Counter(recorded.values())
    return {f"trials_{status.value}": float(counts.get(status.value, 0)) for status in Status}


def run_with_retries(spec: Spec, config: TrialConfig, workdir: Path) -> TrialResult:
    """Launch the trial; re-launch a crash or timeout up to ``limits.retries`` times."""
    for attempt in range(spec.limits.retries + 1):
        result = launch_trial(config, workdir, spec.limits.trial_timeout)
        result.attempts = attempt + 1
        if result.status not in RETRYABLE:
            break
    return result
