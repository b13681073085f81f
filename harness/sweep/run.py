"""A sweep's loop: take a point, run its trial, record it, tell the study, until none is left.

Running the same spec again resumes its sweep: trials already recorded in MLflow are never run
again, and a trial interrupted by a killed sweep is run anew. The start is
``harness.sweep.prepare``, what the sweep says ``harness.sweep.progress``.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from harness.analyse.noise import noise_reason
from harness.record.tracking import trial_run_name
from harness.spec import (
    Spec,
    load_spec,
)
from harness.sweep import claim, plan
from harness.sweep.launch import launch_trial, stop_warm_starter
from harness.sweep.launcher import LaunchRequest, OnThisHost, SweepOutcome
from harness.sweep.prepare import SweepState, prepare, with_tracking
from harness.sweep.progress import (
    NOISE_LINE,
    TRIAL_LINE,
    announce,
    describe,
    left_to_run,
    noise_warning,
    progress_bar,
    start,
    trial_label,
)
from harness.sweep.repeats import repeated
from harness.trial.config import TIMELINE_FILE, TIMELINE_PNG, TrialConfig
from harness.trial.result import RETRYABLE, Status, TrialResult
from harness.waiting import until


class LocalLauncher(OnThisHost):
    """The whole sweep in this process (the default)."""

    name: str = "local"

    def run(self, request: LaunchRequest) -> SweepOutcome:
        return run_sweep(
            request.spec,
            request.console,
            request.fresh,
            request.more_trials,
            request.retry,
            request.top,
        )


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


def run_sweep(
    spec: Spec,
    console: Console,
    fresh: bool = False,
    more_trials: int | None = None,
    retry: str | None = None,
    top: int | None = None,
) -> SweepOutcome:
    """The whole sweep in this process (``--workers N``: ``harness.sweep.workers``)."""
    state = prepare(spec, fresh=fresh, retry=retry)
    from harness.sweep.card_plan import note_shortlist  # pandas: only when a sweep starts

    note_shortlist(state.study, state.plan, top)
    announce(state, console)
    return work(state, console, more_trials)


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
        stop_warm_starter()
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
                proposals = plan.SearchPlan(study, state.plan, recorded, total, shuffle)
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
                        if config.trial_key in proposals.ranks:  # sweep --top: how right
                            result.info["planned_rank"] = proposals.ranks[config.trial_key]
                        problem = draw_timeline(workdir, label)
                        if problem:
                            say(problem, "yellow", relay="")
                        info = {k: result.info.get(k) for k in ("torch_threads", "device")}
                        noisy = noise_reason({**result.metrics, **info})
                        if noisy and not warned_noise:
                            say(noise_warning(label, noisy), "yellow", relay=NOISE_LINE)
                            warned_noise = True
                        if claim.cut_off_before(study, trial, config.trial_key):
                            # its dead worker may have left a run of this point, half-written
                            # or finished just before it died: this one replaces it
                            tracker.discard_point(parent, config.trial_key)
                        run_id = tracker.log_trial(
                            parent, config, result, workdir, started_ms,
                            trial_run_name(label, parent),
                        )  # fmt: skip
                        plan.tell(study, trial, spec, result, run_id)
                    numbered = "" if managed else f"[{index}/{total}] "
                    say(
                        f"{numbered}{label:<28} {config.trial_key[:8]}  {describe(result)}  "
                        f"[{result.wall_time_s or 0:.1f}s]"
                    )
                    progress.update(task, completed=min(total, len(plan.active_keys(study))))
                if not plan.held_by_others(study):
                    break
                # Others are still running points of this sweep: wait until they are done, or
                # one is found dead (its point is free again: take it over).
                until(
                    lambda: claim.fail_stale_trials(study) or not plan.held_by_others(study),
                    every_s=claim.OTHERS_DONE_POLL_S,
                    what="the sweep's other workers",
                )
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


def status_counts(recorded: dict[str, str]) -> dict[str, float]:
    """The parent run's ``trials_<status>`` metrics, over the whole sweep (resumes included);
    every status has one, zero too, so a retried crash no longer counts."""
    counts = Counter(recorded.values())
    return {f"trials_{status.value}": float(counts.get(status.value, 0)) for status in Status}


def run_with_retries(spec: Spec, config: TrialConfig, workdir: Path) -> TrialResult:
    """Launch the trial; re-launch a crash or timeout up to ``limits.retries`` times; run a
    trial that measured a throughput ``train.repeats`` times in all (``repeated``)."""
    result = launch_with_retries(spec, config, workdir)
    if spec.train.repeats < 2 or result.metrics.get("throughput") is None:
        return result
    others = []
    for index in range(1, spec.train.repeats):
        # each repeat in a folder of its own, gone once its throughput is read: the row and
        # its files (timeline, snapshot) are the first run's
        folder = workdir.with_name(f"{workdir.name}.repeat{index}")
        try:
            others.append(launch_with_retries(spec, config, folder))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return repeated(result, others)


def launch_with_retries(spec: Spec, config: TrialConfig, workdir: Path) -> TrialResult:
    for attempt in range(spec.limits.retries + 1):
        result = launch_trial(config, workdir, spec.limits.trial_timeout)
        result.attempts = attempt + 1
        if result.status not in RETRYABLE:
            break
    return result
