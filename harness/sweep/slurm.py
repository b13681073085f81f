"""``harness sweep --launcher slurm``: the sweep as a submitit job array of workers.

Each job of the array is one worker (``SlurmWorker``: the loop of ``harness worker``, in the
job's own process) that takes points from the shared study until none is left; trials still run
each in its own process under it. The job asks Slurm for the GPUs of the grid's largest world
size (``ddp:K``/``fsdp:K``: K; none for ``device: cpu``) and for ``launcher.slurm``'s CPUs,
memory, time, partition and account; ``slurm_<option>`` keys reach submitit as they are.
submitit's files and the jobs' logs go to ``results/<experiment>/slurm/``.

Preemption and time limits: a worker follows submitit's ``Checkpointable`` contract (it has a
``checkpoint`` method, duck-typed so that this module imports without submitit), so on Slurm's
signal submitit requeues the job, which joins the sweep again as a worker. The trial it was
running is cut off; its heartbeat stops, it goes stale and its point runs once more
(``harness.sweep.claim``), on whichever worker takes it.

submitit is imported inside the functions (``pip install 'harness[slurm]'``): the default
install has no use for it. ``launcher.slurm.cluster: local`` runs the same array through
submitit's local executor on this host: the same submission code, real job processes, no Slurm.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

from rich.console import Console

from harness.contract import LAUNCH_ENV, STORAGE_ENV, TRACKING_ENV
from harness.spec import Spec, SpecError
from harness.sweep import remote
from harness.sweep.launcher import LaunchOutcome, LaunchRequest

# submitit takes these when the executor is made, not with the other parameters.
EXECUTOR_OPTIONS = ("slurm_max_num_timeout", "slurm_python", "slurm_max_pickle_size_gb")
NOT_SLURM = (
    " (submit from a Slurm login node, or try the recipe on this host with "
    "launcher.slurm.cluster: local)"
)


class SlurmWorker:
    """One job of the array: ``harness worker`` for the spec at ``spec_path``, run in this
    process from ``cwd`` (the submission's working directory) with the stores of its
    environment (``HARNESS_STORAGE``, ``HARNESS_TRACKING_URI``), which submitit's job inherits
    from the submission."""

    def __init__(self, spec_path: str, cwd: str) -> None:
        self.spec_path = spec_path
        self.cwd = cwd

    def __call__(self, index: int) -> dict[str, Any]:
        from harness.sweep.run import run_worker

        os.chdir(self.cwd)
        outcome = run_worker(
            self.spec_path,
            Console(width=140),
            storage=os.environ.get(STORAGE_ENV),
            tracking_uri=os.environ.get(TRACKING_ENV),
            launch=os.environ.get(LAUNCH_ENV),
        )
        return {"job": index, "host": socket.gethostname(), "parent": outcome.parent_run_id}

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Called by submitit when Slurm preempts the job or its time runs out: requeue the
        same worker (what ``submitit.helpers.Checkpointable`` does), which rejoins the sweep."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, *args, **kwargs)


def parameters(spec: Spec, gpus: int) -> dict[str, Any]:
    """submitit's parameters for each job of the array: one task, one node, the worker's GPUs,
    and what ``launcher.slurm`` asks for (``slurm_<option>`` keys as they are)."""
    settings = spec.launcher.slurm
    chosen: dict[str, Any] = {
        "name": f"harness-{spec.experiment}",
        "timeout_min": max(1, math.ceil(settings.time / 60)),
        "nodes": 1,
        "tasks_per_node": 1,
    }
    if gpus:  # per task on Slurm (one task per job); the local executor knows only per node
        chosen["slurm_gpus_per_task" if settings.cluster == "slurm" else "gpus_per_node"] = gpus
    if settings.cpus_per_task:
        chosen["cpus_per_task"] = settings.cpus_per_task
    if settings.mem:
        chosen["slurm_mem"] = f"{math.ceil(settings.mem / 2**20)}M"  # Slurm's M is MiB
    if settings.partition:
        chosen["slurm_partition"] = settings.partition
    if settings.account:
        chosen["slurm_account"] = settings.account
    extra = settings.passthrough()
    chosen.update({key: value for key, value in extra.items() if key not in EXECUTOR_OPTIONS})
    return chosen


def make_executor(spec: Spec, folder: Path, gpus: int) -> Any:
    """submitit's ``AutoExecutor`` for ``launcher.slurm.cluster``, with every parameter set;
    a parameter submitit refuses is one line naming it."""
    submitit = remote.require("submitit", "slurm")
    settings = spec.launcher.slurm
    source = spec._source or "<spec>"
    options = {k: v for k, v in settings.passthrough().items() if k in EXECUTOR_OPTIONS}
    try:
        executor = submitit.AutoExecutor(folder=folder, cluster=settings.cluster, **options)
    except RuntimeError as error:  # no srun: not a Slurm host
        why = remote.first_line(error, kind=False)
        raise SpecError(f"{source}: launcher.slurm: {why}{NOT_SLURM}") from None
    try:
        executor.update_parameters(**parameters(spec, gpus))
    except (NameError, AssertionError, TypeError, ValueError) as error:
        why = remote.first_line(error, kind=False)
        raise SpecError(f"{source}: launcher.slurm: {why}") from None
    return executor


def launch(spec: Spec, console: Console, wait: bool) -> LaunchOutcome:
    """Submit ``launcher.slurm.jobs`` workers; with ``wait``, follow the study until they end."""
    remote.require("submitit", "slurm")  # before anything is created
    settings = spec.launcher.slurm
    spec = remote.prepare_launch(spec, "slurm")
    path = remote.spec_path(spec)
    folder = (Path(spec.tracking.results_dir) / spec.experiment / "slurm").resolve()
    gpus = remote.gpus_needed(spec)
    executor = make_executor(spec, folder, gpus)
    launch_id = remote.new_launch_id()
    worker = SlurmWorker(path, os.getcwd())
    try:
        with remote.worker_environment(remote.worker_settings(spec, launch_id)):
            jobs = executor.map_array(worker, list(range(settings.jobs)))
    except (OSError, subprocess.CalledProcessError) as error:
        hint = NOT_SLURM if isinstance(error, FileNotFoundError) else ""
        raise SpecError(
            f"{spec._source}: launcher.slurm: submission failed: {remote.first_line(error)}{hint}"
        ) from None
    ids = [str(job.job_id) for job in jobs]
    local = settings.cluster == "local"
    kind = "local submitit job(s) (pids)" if local else "Slurm job(s)"
    console.print(
        f"Submitted {len(ids)} {kind} for sweep [bold]{spec.experiment}[/], "
        f"{gpus} GPU(s) each: {' '.join(ids)}. Logs: {folder}",
        soft_wrap=True,
    )
    outcome = LaunchOutcome(
        "slurm", spec.experiment, spec.tracking.mlflow_uri, ids, wait, remote.trials_wanted(spec)
    )
    if not wait:
        array = ids[0].partition("_")[0]
        outcome.hints = (
            [f"follow the jobs: tail -f {folder}/<id>_0_log.out; stop: kill -INT <id>"]
            if local
            else [f"follow the jobs: squeue -j {array}; sacct -j {array}; stop: scancel {array}"]
        )
        return outcome
    study = remote.StudyWatch(spec, launch_id)
    try:
        remote.watch(
            console, "slurm", study, lambda: sum(not job.done() for job in jobs), len(jobs),
            outcome.total,
        )  # fmt: skip
    except KeyboardInterrupt:
        console.print(
            "\nInterrupted: the local jobs got the interrupt too and stop."
            if local
            else f"\nStopped watching; the jobs go on (scancel {ids[0].partition('_')[0]} "
            "to stop them)."
        )
        raise
    outcome.problems = [problem for job in jobs if (problem := job_problem(job))]
    return remote.finish(outcome, spec, study)


def job_problem(job: Any) -> str | None:
    """One line for a job that ended without returning (killed, failed), else None."""
    log = job.paths.stderr
    if not job.paths.result_pickle.exists():
        return f"job {job.job_id} ended without a result (killed, or its node was lost); log: {log}"
    error = job.exception()
    if error is None:
        return None
    # submitit hands back the job's traceback as text: its last line is the error itself.
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return f"job {job.job_id} failed: {lines[-1].strip() if lines else error!r}; log: {log}"


class SlurmLauncher:
    """``--launcher slurm``: a submitit job array of ``launcher.slurm.jobs`` workers."""

    name: str = "slurm"
    resume_hint: str | None = (
        None  # the watch says whether the jobs stop (local) or go on (a cluster)
    )

    def launch(self, request: LaunchRequest) -> LaunchOutcome:
        return launch(request.spec, request.console, request.wait)
