"""``harness sweep`` and ``harness worker``: run a spec's trials and record them."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click
from rich.console import Console
from rich.markup import escape

from harness.cli.common import HEADINGS, make_console, noise_footnote, table_text
from harness.contract import AXES, LAUNCH_ENV, MANAGED_WORKER_ENV, STORAGE_ENV, TRACKING_ENV
from harness.record.stores import redact
from harness.spec import Spec, SpecError, SweepPlan, load_spec, points
from harness.spec.schema import LAUNCHERS
from harness.sweep.launcher import LaunchOutcome, LaunchRequest

if TYPE_CHECKING:
    import pandas as pd


class RetryChoice(click.Choice):
    """``--retry-failed`` takes an optional value, so a SPEC written after it is read as one:
    say how to write it instead of only "not one of"."""

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> str:
        if isinstance(value, str) and value not in self.choices:
            self.fail(
                f"{value!r} is not failed or all (write SPEC before --retry-failed, or "
                "--retry-failed=failed / --retry-failed=all)",
                param,
                ctx,
            )
        return super().convert(value, param, ctx)


@click.command()
@click.argument("spec_path", metavar="SPEC", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--fresh",
    is_flag=True,
    help="Start a new sweep even if this spec already ran (earlier runs stay in MLflow).",
)
@click.option("--dry-run", is_flag=True, help="List the planned trials and exit.")
@click.option(
    "--n-trials",
    type=click.IntRange(min=1),
    default=None,
    help="search.method optuna only: run this many trials more than are recorded already.",
)
@click.option(
    "--top",
    type=click.IntRange(min=1),
    default=None,
    help="Run first the K points `harness plan` predicts fastest among those that fit this "
    "host's card (Optuna: its study is seeded with them); each records its planned_rank.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Run N trials at once in N worker processes sharing the study (one per GPU on a "
    "multi-GPU host; on a CPU they distort throughput).",
)
@click.option(
    "--retry-failed",
    "retry",
    type=RetryChoice(["failed", "all"]),
    is_flag=False,
    flag_value="failed",
    default=None,
    help="Run recorded crash and timeout trials again (=all: also oom, diverged, "
    "infeasible), replacing their records in the same sweep.",
)
@click.option(
    "--launcher",
    type=click.Choice(LAUNCHERS),
    default=None,
    help="Who starts the workers: local (this host, the default), slurm (a submitit job "
    "array) or ray (actors on a Ray cluster); overrides the spec's launcher.name.",
)
@click.option(
    "--wait",
    is_flag=True,
    help="--launcher slurm: stay until the jobs end, showing progress from the study, then "
    "the summary (ray always waits; local is always in this process).",
)
def sweep(
    spec_path: Path,
    fresh: bool,
    dry_run: bool,
    n_trials: int | None,
    workers: int,
    retry: str | None,
    launcher: str | None,
    wait: bool,
    top: int | None,
) -> None:
    """Run the trials of SPEC (each in its own process) and record them in MLflow.

    Grid: every point. Optuna: search.n_trials points chosen by the sampler. Running the same
    SPEC again resumes: recorded trials are kept and never re-run (--retry-failed runs the
    failed ones again). A trial's identity includes this host's device and its name, so the
    same SPEC on other hardware is a new sweep. Exit status: 0 when every trial has a
    result (ok, oom, diverged, infeasible), 1 when any crashed or timed out, 2 on bad input,
    130 when interrupted (Ctrl-C), 143 when terminated (SIGTERM): both stop the running trial,
    keep every finished one recorded, and the same command resumes. With --launcher slurm|ray
    the workers run on a cluster (README "Many machines").
    """
    spec = load_spec(spec_path)
    if launcher:
        spec = with_launcher(spec, launcher)
    remote = spec.launcher.name != "local"
    if remote and not dry_run:
        check_remote_options(spec, fresh, retry, n_trials, workers)
    if top is not None and remote:
        raise SpecError(
            f"{spec_path}: --top runs on this host's launcher only (local, --workers N); plan "
            "the shortlist with `harness plan` and sweep it there"
        )
    if retry and fresh:
        raise SpecError(
            f"{spec_path}: --retry-failed and --fresh: a fresh sweep has nothing to retry"
        )
    if n_trials is not None and spec.search.method != "optuna":
        raise SpecError(
            f"{spec_path}: --n-trials needs search.method: optuna (this spec is a grid that "
            "runs all its points)"
        )
    if n_trials is not None and workers > 1:
        raise SpecError(
            f"{spec_path}: --n-trials and --workers: add the extra trials in one worker"
        )
    console = make_console()
    if dry_run:
        if spec.search.method == "optuna":
            console.print(
                f"search space: Optuna's {spec.search.sampler} sampler picks "
                f"{spec.search.n_trials} of these {len(points(spec))} points"
            )
        from harness.trial.hardware import describe_hardware, host_hardware

        hardware = host_hardware(spec.device)
        console.print(f"hardware: {describe_hardware(hardware)} (part of each trial_key)")
        from harness.sweep.prepare import resolve_max_batch
        from harness.sweep.progress import max_batch_lines

        # as the sweep does: the host's hardware and the found batches are in the keys
        sweep = resolve_max_batch(SweepPlan(spec).on_hardware(hardware))
        for line in max_batch_lines(sweep):
            console.print(line, soft_wrap=True, markup=False, highlight=False)
        recorded, note = recorded_before(sweep)
        for index, point in enumerate(sweep.points, start=1):
            config = sweep.trial_config(point)
            searched = f"max:{config.batch_size}"  # the found batch, as progress lines show it
            shown = {**point, "batch_size": searched} if config.batch_size_search else point
            status = recorded.get(config.trial_key)
            mark = f"  recorded ({status}): will not run" if status else ""
            console.print(f"{index:>4}  {config.trial_key}  {shown}{mark}", highlight=False)
        console.print(note, soft_wrap=True, highlight=False, markup=False)
        return
    stop_on_sigterm()
    from harness.sweep.launchers import launcher_for

    chosen = launcher_for(spec.launcher.name, workers)
    request = LaunchRequest(spec, console, fresh, n_trials, retry, workers, wait, top)
    try:
        outcome = chosen.launch(request)
    except KeyboardInterrupt as stop:
        hint = chosen.resume_hint
        stopped(console if hint else None, stop, hint or "")
    report(console, outcome)


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a scheduler ending the job): handled as Ctrl-C is, so every trial
    process is killed and every finished trial stays recorded; exit status 143."""


def stop_on_sigterm() -> None:
    def terminate(signum: int, frame: object) -> None:
        raise Terminated()

    signal.signal(signal.SIGTERM, terminate)


def exit_code(stop: KeyboardInterrupt) -> int:
    """130 for Ctrl-C (SIGINT), 143 for SIGTERM: 128 + the signal, as a shell reports it."""
    return 128 + (signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT)


def stopped(console: Console | None, stop: KeyboardInterrupt, resume: str) -> NoReturn:
    """Say what stopped the sweep and how to go on (``console`` None: say nothing), and exit."""
    if console is not None:
        what = "Terminated (SIGTERM)" if isinstance(stop, Terminated) else "Interrupted"
        console.print(f"\n{what}. Finished trials are recorded; {resume}.", highlight=False)
    sys.exit(exit_code(stop))


def recorded_before(sweep: SweepPlan) -> tuple[dict[str, str], str]:
    """``--dry-run``: the points MLflow already holds for this sweep (``trial_key -> status``)
    and a line saying how many will run, read without writing to any store."""
    from harness.record.store_checks import first_line
    from harness.record.tracking import recorded_for
    from harness.sweep.plan import study_name

    spec, total = sweep.spec, len(sweep.points)
    try:
        recorded = recorded_for(spec.tracking.mlflow_uri, spec.experiment, study_name(sweep))
    except Exception as error:  # a dry run still lists the plan; it says what it could not read
        return {}, (
            f"{total} point(s); which are recorded is unknown: cannot read "
            f"{redact(spec.tracking.mlflow_uri)} ({redact(first_line(error))})"
        )
    if spec.search.method != "grid":
        wanted = spec.search.n_trials or 0
        return recorded, f"{len(recorded)} recorded; the sampler picks up to {wanted} in all"
    return recorded, f"{len(recorded)} of {total} point(s) recorded; {total - len(recorded)} to run"


def with_launcher(spec: Spec, name: str) -> Spec:
    """The spec with ``launcher.name`` replaced (``--launcher``), source kept."""
    copy = spec.model_copy(update={"launcher": spec.launcher.model_copy(update={"name": name})})
    copy._source = spec._source
    return copy


def check_remote_options(
    spec: Spec, fresh: bool, retry: str | None, n_trials: int | None, workers: int
) -> None:
    """Options a cluster launch cannot honour, refused in one line before anything starts.

    The workers key their trials to the hardware of their nodes, so the study they use is
    chosen there: this host can neither delete it (``--fresh``) nor retry or extend it."""
    name = spec.launcher.name
    source = spec._source
    if workers > 1:
        count = "launcher.slurm.jobs" if name == "slurm" else "launcher.ray.workers"
        raise SpecError(
            f"{source}: --workers and --launcher {name}: the launcher starts {count} workers"
        )
    for given, flag in ((fresh, "--fresh"), (retry, "--retry-failed"), (n_trials, "--n-trials")):
        if given:
            instead = " (or set tracking.experiment for a new sweep)" if flag == "--fresh" else ""
            raise SpecError(
                f"{source}: {flag} and --launcher {name}: the workers' study is chosen by their "
                f"hardware on the nodes; run `harness sweep SPEC {flag}` on such a node{instead}"
            )


def report(console: Console, outcome: LaunchOutcome) -> None:
    """What a launch recorded, the same for every launcher: a summary per parent run (one per
    hardware its workers ran on) and the exit status; for a launch not waited for, how to
    follow it."""
    if not outcome.waited:
        for hint in outcome.hints:
            console.print(hint, soft_wrap=True, highlight=False, markup=False)
        console.print(
            f"follow the sweep: harness results --experiment {outcome.experiment} "
            f"--tracking-uri {redact(outcome.tracking_uri)} (or launch with --wait)",
            soft_wrap=True,
            highlight=False,
            markup=False,
        )
        return
    for problem in outcome.problems:
        console.print(f"[yellow]warning:[/] {escape(problem)}", soft_wrap=True, highlight=False)
    counts: dict[str, int] = {}
    for parent in outcome.parents:
        found = print_summary(console, outcome.experiment, outcome.tracking_uri, parent)
        for status, count in found.items():
            counts[status] = counts.get(status, 0) + count
    if outcome.missing:
        console.print(
            f"exit status 1: {outcome.missing} of the sweep's trials have no record (every "
            "worker ended first); launch again to run them",
            highlight=False,
        )
        sys.exit(1)
    exit_for_failures(console, counts)


# Statuses that are results (the trial ran, or was rightly not run) vs failures to measure.
FAILED_STATUSES = ("crash", "timeout")


def exit_for_failures(console: Console, counts: dict[str, int]) -> None:
    """Exit 1 when any trial crashed or timed out, so scripts and CI see it; ok, oom,
    diverged and infeasible are measurements, not failures (exit 0)."""
    failed = {status: counts[status] for status in FAILED_STATUSES if counts.get(status)}
    if failed:
        what = " and ".join(f"{n} {status}" for status, n in failed.items())
        console.print(
            f"exit status 1: {what} (no measurement); `harness results` shows each failure_reason",
            highlight=False,
        )
        sys.exit(1)


@click.command()
@click.argument("spec_path", metavar="SPEC", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--storage",
    default=None,
    envvar=STORAGE_ENV,
    show_envvar=True,
    help="Optuna storage shared by all workers (postgresql://..., journal:PATH); "
    "default: the spec's tracking.storage. A URL with a password belongs in the "
    "environment variable, not on the command line (visible in ps).",
)
@click.option(
    "--tracking-uri",
    default=None,
    envvar=TRACKING_ENV,
    show_envvar=True,
    help="MLflow tracking URI shared by all workers (e.g. http://host:5000); "
    "default: the spec's tracking.mlflow_uri.",
)
def worker(spec_path: Path, storage: str | None, tracking_uri: str | None) -> None:
    """Join SPEC's sweep from this process (any host) and run trials until none is left.

    Start one per GPU host against the same PostgreSQL storage and MLflow tracking server (or
    let `harness sweep --launcher slurm|ray` start them); every grid point runs exactly once,
    on whichever worker claims it.
    """
    from harness.sweep.run import run_worker

    console = make_console()
    managed = os.environ.get(MANAGED_WORKER_ENV) == "1"
    stop_on_sigterm()
    try:
        run_worker(spec_path, console, storage, tracking_uri, os.environ.get(LAUNCH_ENV), managed)
    except KeyboardInterrupt as stop:
        # a worker of `harness sweep --workers N`: that command says what happened
        stopped(None if managed else console, stop, "start the worker again to go on")


def print_per_budget(console: Console, frame: pd.DataFrame) -> None:
    """The best configuration for each memory budget the trials span, one line each: where the
    best changes as memory grows (``analyse.pareto.best_per_budget``)."""
    from harness.analyse.pareto import best_per_budget
    from harness.units import format_bytes

    picks = best_per_budget(frame)
    if picks.empty:
        return
    within = [f"<= {format_bytes(b, short=True)}" for b in picks["budget"]]
    picks = picks.assign(**{"memory budget": within})
    columns = [
        "memory budget",
        *AXES,
        "trial_key",
        "peak_allocated_bytes",
        "throughput",
        "accuracy",
    ]
    console.print(
        table_text(
            picks,
            columns,
            HEADINGS,
            title="Best strategy per memory budget: the fastest within noise, then the most "
            "accurate, whose measured peak fits (another budget: harness recommend --budget SIZE)",
        ),
        highlight=False,
        markup=False,
        soft_wrap=True,
    )


def print_summary(
    console: Console, experiment: str, tracking_uri: str, parent_run_id: str
) -> dict[str, int]:
    """The sweep's outcome per status and its best configurations; the counts per status."""
    import pandas as pd

    from harness.record.results import load

    frame = load(experiment, tracking_uri, sweep=parent_run_id)
    counts = {str(k): int(v) for k, v in frame["status"].value_counts().to_dict().items()}
    console.print(
        f"\n[bold]{len(frame)} trials[/]: "
        + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    )
    ok = frame[frame["status"] == "ok"]
    if not ok.empty:
        columns = ["best for", *AXES, "trial_key", "peak_allocated_bytes", "throughput", "accuracy"]
        picks = [
            ("least memory", ok.nsmallest(2, "peak_allocated_bytes")),
            ("most throughput", ok.nlargest(2, "throughput")),
            ("best accuracy", ok.nlargest(2, "accuracy")),
        ]
        best = pd.concat(
            [rows.assign(**{"best for": [label] + [""] * (len(rows) - 1)}) for label, rows in picks]
        )
        console.print(
            table_text(best, columns, HEADINGS, title="Best configurations (ok trials)"),
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
        footnote = noise_footnote(ok)
        if footnote:
            console.print(footnote, highlight=False, markup=False, soft_wrap=True)
        print_per_budget(console, frame)
    from harness.record.tracking import ui_hint

    console.print(
        f"Next: {ui_hint(tracking_uri, experiment)} (the trials' runs, key metrics as columns), "
        f"[bold]harness results --experiment {experiment}[/] (the table), "
        "or harness.results.load() in Python.",
        soft_wrap=True,
    )
    return counts
