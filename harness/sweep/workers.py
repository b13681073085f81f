"""``harness sweep --workers N``: N worker processes on this host share one sweep.

The sweep is prepared here (study, MLflow parent run); then N ``harness worker`` processes take
its points (``harness.sweep.claim``). A SQLite study becomes a journal file, since SQLite is
not safe for concurrent writers; on a multi-GPU host each worker gets its own GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

from rich.console import Console

from harness.record.stores import redact, shared_storage
from harness.spec import Spec, points
from harness.sweep.run import SweepOutcome, prepare, status_counts, with_tracking


def run_with_workers(spec: Spec, console: Console, fresh: bool, workers: int) -> SweepOutcome:
    """``--workers N``: prepare the sweep here, then N ``harness worker`` processes share it."""
    storage = shared_storage(spec.tracking.storage)
    if storage != spec.tracking.storage:
        console.print(
            f"{workers} workers share the study through {redact(storage)} "
            "(SQLite is not safe for concurrent writers)."
        )
        spec = with_tracking(spec, storage=storage)
    warn_about_cpu_sharing(console, spec)
    state = prepare(spec, fresh=fresh, runs_trials=False)
    source = spec._source or ""
    command = [
        sys.executable, "-m", "harness", "worker", source,
        "--storage", spec.tracking.storage, "--tracking-uri", spec.tracking.mlflow_uri,
    ]  # fmt: skip
    processes = []
    for index in range(workers):
        env = dict(os.environ)
        gpu = gpu_for_worker(index)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        processes.append(subprocess.Popen(command, env=env))
    try:
        codes = [process.wait() for process in processes]
    except KeyboardInterrupt:
        for process in processes:
            process.terminate()
        raise
    if any(codes):
        console.print(f"[red]worker exit codes: {codes}[/]")
    recorded = state.tracker.recorded_trials(state.parent)
    state.tracker.close_sweep(state.parent, status_counts(recorded))
    return SweepOutcome(spec.experiment, state.parent, len(points(spec)), len(recorded))


def gpu_count() -> int:
    """GPUs this host has (torch is imported here only for this, never to run a trial)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_for_worker(index: int) -> str | None:
    """One GPU per worker on a multi-GPU host (round robin); None on a CPU-only machine."""
    count = gpu_count()
    return str(index % count) if count > 1 else None


def warn_about_cpu_sharing(console: Console, spec: Spec) -> None:
    if spec.device in ("cpu",) or not gpu_count():
        console.print(
            "[yellow]warning:[/] parallel trials on one CPU share its cores: memory figures "
            "are unaffected, but throughput and step times are distorted. Compare throughput "
            "only from sweeps run with one worker."
        )
