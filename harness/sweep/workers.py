"""``harness sweep --workers N``: N worker processes on this host share one sweep.

The sweep is prepared here (study, MLflow parent run); then N ``harness worker`` processes take
its points (``harness.sweep.claim``). A SQLite study becomes a journal file, since SQLite is
not safe for concurrent writers; on a multi-GPU host each worker gets GPUs of its own (as many as
its largest trial's world size), and more workers than the GPUs allow are refused.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading

from rich.console import Console

from harness.contract import MANAGED_WORKER_ENV, STORAGE_ENV, TRACKING_ENV
from harness.record.stores import redact, shared_storage
from harness.spec import Spec, SpecError, trial_configs
from harness.sweep.launcher import LaunchRequest, OnThisHost, SweepOutcome
from harness.sweep.prepare import SweepState, prepare, with_tracking
from harness.sweep.progress import NOISE_LINE, TRIAL_LINE, announce, progress_bar, start
from harness.sweep.run import status_counts


def run_with_workers(
    spec: Spec,
    console: Console,
    fresh: bool,
    workers: int,
    retry: str | None = None,
    top: int | None = None,
) -> SweepOutcome:
    """``--workers N``: prepare the sweep here, then N ``harness worker`` processes share it,
    shown as one sweep: one header, one progress bar, one line per finished trial."""
    storage = shared_storage(spec.tracking.storage)
    if storage != spec.tracking.storage:
        console.print(
            f"{workers} workers share the study through {redact(storage)} "
            "(SQLite is not safe for concurrent writers).",
            soft_wrap=True,
        )
        spec = with_tracking(spec, storage=storage)
    gpus = gpu_count()
    per_worker = gpus_per_worker(spec)
    check_gpus(spec, workers, per_worker, gpus)
    state = prepare(spec, fresh=fresh, runs_trials=False, retry=retry)
    from harness.sweep.card_plan import note_shortlist  # pandas: only when a sweep starts

    note_shortlist(state.study, state.plan, top)
    announce(state, console)
    left = start(state, console)
    if not left.to_run:
        return close(state, left.total)
    warn_about_cpu_sharing(console, spec)
    # The stores go by environment, not argv: a password in a URL would show in `ps`.
    command = [sys.executable, "-m", "harness", "worker", spec._source or ""]
    stores = {STORAGE_ENV: spec.tracking.storage, TRACKING_ENV: spec.tracking.mlflow_uri}
    processes = []
    for index in range(workers):
        env = {**os.environ, **stores, MANAGED_WORKER_ENV: "1"}
        visible = gpus_for_worker(index, per_worker, gpus)
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        processes.append(
            subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
            )
        )
    try:
        codes = show_workers(console, processes, len(left.recorded), left.total)
    except KeyboardInterrupt:
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            process.wait()
        state.tracker.close_sweep(state.parent, {}, status="KILLED")
        raise
    if any(codes):
        console.print(f"[red]worker exit codes: {codes}[/]")
    return close(state, left.total)


def close(state: SweepState, total: int) -> SweepOutcome:
    """The parent run finished with its counts per status, once no worker is left."""
    recorded = state.tracker.recorded_trials(state.parent)
    state.tracker.close_sweep(state.parent, status_counts(recorded))
    return SweepOutcome(state.spec.experiment, state.parent, total, len(recorded))


def show_workers(
    console: Console, processes: list[subprocess.Popen[str]], recorded: int, total: int
) -> list[int]:
    """Relay the workers' lines under one progress bar until every worker has ended; their
    exit codes. Each finished trial is numbered in the order it finished; of the workers'
    noise warnings only the first is shown (every noisy figure carries its mark)."""
    lines: queue.Queue[tuple[int, str | None]] = queue.Queue()

    def read(index: int, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put((index, line.rstrip("\n")))
        lines.put((index, None))

    for index, process in enumerate(processes):
        threading.Thread(target=read, args=(index, process), daemon=True).start()
    finished, open_streams, warned = recorded, len(processes), False
    progress = progress_bar(console)
    with progress:
        task = progress.add_task(running(len(processes)), total=total, completed=finished)
        while open_streams:
            index, line = lines.get()
            if line is None:
                open_streams -= 1
                alive = sum(process.poll() is None for process in processes)
                progress.update(task, description=running(alive))
                continue
            if line.startswith(TRIAL_LINE):
                finished += 1
                line = f"[{finished}/{total}] {line.removeprefix(TRIAL_LINE)}"
                progress.update(task, completed=min(finished, total))
            elif line.startswith(NOISE_LINE):
                if warned:
                    continue
                warned, line = True, line.removeprefix(NOISE_LINE)
            else:
                line = f"worker {index + 1}: {line}"
            progress.console.print(line, soft_wrap=True, markup=False, highlight=False)
    return [process.wait() for process in processes]


def running(workers: int) -> str:
    return f"{workers} worker{'' if workers == 1 else 's'} running"


def gpu_count() -> int:
    """GPUs this host has (torch is imported here only for this, never to run a trial)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpus_per_worker(spec: Spec) -> int:
    """GPUs one worker needs: its largest trial's world size (``ddp:K``/``fsdp:K``: K)."""
    return max(config.world_size for config in trial_configs(spec))


def check_gpus(spec: Spec, workers: int, per_worker: int, gpus: int) -> None:
    """Refuse, before anything starts, N workers of K GPUs each on a host with fewer than
    N*K: they would share cards and measure each other's memory and speed."""
    if gpus and workers * per_worker > gpus:
        raise SpecError(
            f"{spec._source or '<spec>'}: --workers {workers}: each worker needs {per_worker} "
            f"GPU(s) (its largest trial's world size) and this host has {gpus}; use "
            f"--workers {max(1, gpus // per_worker)} or fewer"
        )


def gpus_for_worker(index: int, per_worker: int, gpus: int) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for worker ``index``: its own ``per_worker`` GPUs (worker 0 the
    first K, worker 1 the next K, ...); None on a CPU-only or one-GPU host (nothing to split)."""
    if gpus <= 1:
        return None
    first = index * per_worker
    return ",".join(str(gpu) for gpu in range(first, first + per_worker))


def warn_about_cpu_sharing(console: Console, spec: Spec) -> None:
    if spec.device in ("cpu",) or not gpu_count():
        console.print(
            "[yellow]warning:[/] parallel trials on one CPU share its cores: memory figures "
            "are unaffected, but throughput and step times are distorted. Compare throughput "
            "only from sweeps run with one worker."
        )


class WorkersLauncher(OnThisHost):
    """``--workers N``: N ``harness worker`` processes on this host, shown as one sweep."""

    name: str = "workers"

    def run(self, request: LaunchRequest) -> SweepOutcome:
        return run_with_workers(
            request.spec,
            request.console,
            request.fresh,
            request.workers,
            request.retry,
            request.top,
        )
