"""Run one trial in its own process, with a timeout, and classify how it ended.

Isolation is the point: a trial that segfaults, hangs or leaks memory takes only its own process
down. The process leads a new session, so on a timeout (or Ctrl-C of the sweep) the whole tree is
killed, grandchildren included. Single-process trials are forked from a warm zygote that has
already imported torch (``harness.trial.zygote``): the same isolation, without seconds of
imports per trial.

torchrun starts each rank in a session of its own, out of reach of that kill; so every trial
carries this process's identity and its own tag in its environment (``harness.lifeline``): a
trial exits by itself when this process is gone, and whatever a trial leaves behind, however it
ended, is found by its tag and killed before ``launch_trial`` returns.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from harness import lifeline
from harness.pipes import LineReader, PipeClosed
from harness.trial.config import (
    SNAPSHOT_FILE,
    STEP_TIMES_FILE,
    TIMELINE_FILE,
    TIMELINE_PNG,
    TrialConfig,
)
from harness.trial.result import Status, TrialResult

TRIAL_FILES = (TIMELINE_FILE, TIMELINE_PNG, SNAPSHOT_FILE, STEP_TIMES_FILE)


def _kill_tree(process: subprocess.Popen[bytes]) -> None:
    _kill_group(process.pid)
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


WARM_START_ENV = "HARNESS_WARM_START"  # "0": every trial imports everything in a fresh process
ZYGOTE_READY_S = 300.0  # imports on a loaded machine can be slow; a dead zygote answers at once


class ZygoteFailed(Exception):
    """The warm starter is unusable; the trial starts in a fresh process instead."""


class Zygote:
    """The launcher's end of ``harness.trial.zygote``: one trial at a time, answers read with a
    timeout, the trial's process group killed on timeout or Ctrl-C."""

    def __init__(self) -> None:
        # What the zygote printed, if it fails to start; closed with the zygote.
        self.errors = tempfile.TemporaryFile()  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "harness.trial.zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errors,
        )
        assert self.process.stdout is not None
        self.answers = LineReader(self.process.stdout.fileno())
        self.ready = False

    def _read(self, timeout_s: float) -> dict[str, Any] | None:
        """The next answer, or None after ``timeout_s``; ZygoteFailed if the zygote is gone."""
        try:
            line = self.answers.line(timeout_s)
        except PipeClosed:
            self.process.wait()
            self.errors.seek(0)
            tail = self.errors.read().decode(errors="replace").strip().splitlines()[-1:]
            raise ZygoteFailed(
                f"exited with code {self.process.returncode}"
                + (f": {tail[0][:300]}" if tail else "")
            ) from None
        return None if line is None else json.loads(line)

    def _expect(self, key: str, timeout_s: float) -> Any:
        answer = self._read(timeout_s)
        if answer is None or key not in answer:
            self.close()
            raise ZygoteFailed(f"no {key!r} answer within {timeout_s:g}s (got {answer!r})")
        return answer[key]

    def run(self, request: dict[str, Any], timeout_s: float) -> int | None:
        """Run one trial; its exit code (negative: signal), or None when it timed out."""
        if not self.ready:
            self._expect("ready", ZYGOTE_READY_S)
            self.ready = True
        assert self.process.stdin is not None
        try:
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
        except OSError as error:
            raise ZygoteFailed(f"cannot reach it: {error}") from None
        pid = self._expect("pid", 60)
        try:
            answer = self._read(timeout_s)
        except BaseException:  # Ctrl-C, a kill of the sweep, or the zygote died: no orphan
            _kill_group(pid)
            raise
        if answer is not None:
            return int(answer["exit"])
        _kill_group(pid)
        self._expect("exit", 60)
        return None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.process.stdin:
                self.process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.errors.close()


_zygotes = threading.local()  # one per launching thread: each runs one trial at a time


def warm_start_enabled() -> bool:
    return os.environ.get(WARM_START_ENV, "1") != "0"


def start_warm_starter() -> None:
    """Start this thread's zygote now, so its imports overlap the sweep's own set-up."""
    if warm_start_enabled() and getattr(_zygotes, "zygote", None) is None:
        _zygotes.zygote = Zygote()
        atexit.register(_zygotes.zygote.close)


def stop_warm_starter() -> None:
    """Kill this thread's zygote at once: a sweep with nothing left to run need not wait for it
    to finish importing torch, nor spend a core on it meanwhile."""
    zygote = getattr(_zygotes, "zygote", None)
    if zygote is not None:
        _zygotes.zygote = None
        zygote.process.kill()
        zygote.close()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # not yet its own group leader, or already gone
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _run_warm(request: dict[str, Any], timeout_s: float) -> int | None:
    """Fork the trial from this thread's zygote; ZygoteFailed when that is not possible."""
    start_warm_starter()
    zygote: Zygote = _zygotes.zygote
    try:
        return zygote.run(request, timeout_s)
    except ZygoteFailed as error:
        _zygotes.zygote = None
        zygote.close()
        logging.getLogger("harness").warning(
            "warm trial start failed (%s); trials start in fresh processes", error
        )
        os.environ[WARM_START_ENV] = "0"
        raise


def _run_fresh(
    command: list[str], env: dict[str, str], log_path: Path, timeout_s: float
) -> int | None:
    """The trial as its own program; its exit code, or None when it timed out."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(process)
            return None
        except BaseException:  # Ctrl-C or a kill of the sweep: leave no orphan trial behind
            _kill_tree(process)
            raise


def launch_trial(config: TrialConfig, workdir: Path, timeout_s: float) -> TrialResult:
    """Run ``python -m harness.trial`` for ``config`` in ``workdir``; always return a result.

    ``workdir`` keeps ``config.json``, ``result.json`` and ``trial.log`` (stdout + stderr).
    A single-process trial is forked from a warm zygote (``harness.trial.zygote``) unless
    ``HARNESS_WARM_START=0``; a multi-rank one is started by torchrun. No process of the trial
    outlives the call (``harness.lifeline``): torchrun's ranks, which its process group does
    not hold, are found by the trial's tag and killed, on a timeout, a Ctrl-C or any ending.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    config_path, result_path, log_path = (
        workdir / "config.json",
        workdir / "result.json",
        workdir / "trial.log",
    )
    config_path.write_text(config.to_json())
    for stale in (result_path, *(workdir / name for name in TRIAL_FILES)):
        stale.unlink(missing_ok=True)  # left by an earlier attempt at this trial
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **lifeline.trial_environment(workdir)}
    lifeline.end_launched_at_exit()
    command = [sys.executable, "-m", "harness.trial", str(config_path), str(result_path)]
    ranks = config.world_size
    grouped = config.strategy.needs_process_group  # ddp:1 and fsdp:1 too
    if grouped:  # torchrun starts the ranks; if one dies it stops the others
        command[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    started = time.monotonic()
    returncode: int | None = None
    warm = not grouped and warm_start_enabled()
    try:
        if warm:
            request = {
                "config": str(config_path.resolve()),
                "result": str(result_path.resolve()),
                "log": str(log_path.resolve()),
                "cwd": os.getcwd(),
                "env": env,
            }
            try:
                returncode = _run_warm(request, timeout_s)
            except ZygoteFailed:  # reported once; this trial and the rest start fresh
                warm = False
                result_path.unlink(missing_ok=True)
                started = time.monotonic()
        if not warm:
            returncode = _run_fresh(command, env, log_path, timeout_s)
        wall = time.monotonic() - started
    finally:  # ranks torchrun had started, or a rank still starting up: none outlives the trial
        lifeline.end_trial(workdir)
    start = "warm" if warm else "torchrun" if grouped else "fresh"
    key = config.trial_key
    if returncode is None:
        reason = f"no result after the {timeout_s:g}s trial_timeout; killed"
        result = TrialResult.failure(key, Status.TIMEOUT, reason)
    elif result_path.exists():
        result = TrialResult.from_json(result_path.read_text())
    elif returncode < 0:
        result = TrialResult.failure(key, Status.CRASH, f"killed by {_signal_name(-returncode)}")
    else:
        detail = _last_log_line(log_path) or "no output"
        reason = f"exited with code {returncode} without a result: {detail}"
        result = TrialResult.failure(key, Status.CRASH, reason)
    result.wall_time_s = wall
    result.info["trial_start"] = start
    return result
