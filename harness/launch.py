"""Run one trial in its own process, with a timeout, and classify how it ended.

Isolation is the point: a trial that segfaults, hangs or leaks memory takes only its own process
down. The process leads a new session, so on a timeout (or Ctrl-C of the sweep) the whole tree is
killed, grandchildren included.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.strategies import world_size
from harness.trial.config import TrialConfig
from harness.trial.outcome import Status, failure_result
from harness.units import format_bytes

RETRYABLE = {Status.CRASH.value, Status.TIMEOUT.value}


def failure(config: TrialConfig, status: Status, reason: str) -> dict[str, Any]:
    return failure_result(config.trial_key, status, reason)


def _kill_tree(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _last_log_line(log_path: Path) -> str:
    try:
        lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines()]
    except OSError:
        return ""
    lines = [line for line in lines if line]
    return lines[-1][:300] if lines else ""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def launch_trial(config: TrialConfig, workdir: Path, timeout_s: float) -> dict[str, Any]:
    """Run ``python -m harness.trial`` for ``config`` in ``workdir``; always return a result.

    ``workdir`` keeps ``config.json``, ``result.json`` and ``trial.log`` (stdout + stderr).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    config_path, result_path, log_path = (
        workdir / "config.json",
        workdir / "result.json",
        workdir / "trial.log",
    )
    config_path.write_text(config.to_json())
    result_path.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "harness.trial", str(config_path), str(result_path)]
    ranks = world_size(config.strategy)
    if ranks > 1:  # torchrun starts the ranks; if one dies it stops the others
        command[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    started = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(process)
            result = failure(
                config, Status.TIMEOUT, f"no result after the {timeout_s:g}s trial_timeout; killed"
            )
            result["wall_time_s"] = time.monotonic() - started
            return result
        except BaseException:  # Ctrl-C or a kill of the sweep: leave no orphan trial behind
            _kill_tree(process)
            raise
    wall = time.monotonic() - started
    if result_path.exists():
        result = json.loads(result_path.read_text())
    elif returncode < 0:
        result = failure(config, Status.CRASH, f"killed by {_signal_name(-returncode)}")
    else:
        detail = _last_log_line(log_path) or "no output"
        result = failure(
            config, Status.CRASH, f"exited with code {returncode} without a result: {detail}"
        )
    result["wall_time_s"] = wall
    return result


def describe(result: dict[str, Any]) -> str:
    """A short human summary of a result for progress lines."""
    metrics = result.get("metrics", {})
    parts = [result["status"]]
    if "peak_allocated_bytes" in metrics:
        parts.append(f"peak {format_bytes(metrics['peak_allocated_bytes'])}")
    if "throughput" in metrics:
        unit = result.get("info", {}).get("throughput_unit", "samples/s")
        parts.append(f"{metrics['throughput']:,.0f} {unit}")
    if "accuracy" in metrics:
        parts.append(f"acc {metrics['accuracy']:.3f}")
    if result.get("failure_reason"):
        parts.append(f"({result['failure_reason']})")
    return "  ".join(parts)
