"""A warm trial starter: ``python -m harness.trial.zygote`` imports torch and the trial code once,
then forks one fresh child process per trial.

Why: a trial process spends ~2-3 s importing torch, torchvision and the trial layer before it
trains; on short trials that start-up, not training, would dominate a sweep's wall time. Forking
an already-imported process keeps every isolation guarantee of a fresh process (its own address
space, so fresh peak counters and RSS high-water mark, no tensors or allocator cache carried
over, a crash or hang takes only the child) without paying the imports again. The zygote itself
never runs a trial, builds a tensor or touches CUDA, so every child starts from the same state.

Why not ``multiprocessing``'s forkserver: its children re-import the launching program's
``__main__`` (the whole CLI) and unpickle their target; a trial needs neither, only its command
line's two paths, its environment and its own process session.

Protocol (one launcher, one trial at a time): the launcher writes one JSON line
``{"config", "result", "log", "cwd", "env"}``; the zygote answers ``{"pid": N}`` once the child
runs and ``{"exit": CODE}`` when it ends (negative: killed by that signal, as ``subprocess``
reports it). End of input (the launcher closed the pipe or died) ends the zygote, and it kills a
trial still running, so no trial outlives its sweep.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import select
import signal
import sys
from typing import Any, cast

POLL_S = 0.02  # without a pidfd: how often a running trial's zygote looks at it


def preload() -> None:
    """Import what every trial needs: torch, the trial's run (loop, estimator), every registered
    model family's and dataset's module (torchvision among them). Missing extras are skipped.

    Imports only: running anything here would be inherited by every child, and some of it
    cannot be (autograd's engine threads refuse to run in a forked child once started: a
    warm-up estimate here, which saved ~0.1 s a trial, made every trial crash).
    """
    import torch  # noqa: F401

    from harness.workloads import DATASETS, FAMILIES

    modules = ["harness.trial.__main__", "harness.trial.run"]
    modules += [family.builder.partition(":")[0] for family in FAMILIES.values()]
    modules += [dataset.loader.partition(":")[0] for dataset in DATASETS.values()]
    for name in modules:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def become_trial(request: dict[str, Any]) -> int:
    """In the forked child: a process of its own session, output to the trial log, the
    launcher's environment and working directory, then the trial worker's ``main``."""
    os.setsid()  # its own process group: a timeout kills the trial's whole tree
    signal.signal(signal.SIGINT, signal.default_int_handler)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (lives as long as us)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # the zygote read its own environment at import
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = ["harness.trial", request["config"], request["result"]]
    from harness.trial.__main__ import main

    return main([request["config"], request["result"]])


def run_child(request: dict[str, Any], replies: int) -> None:
    os.close(replies)
    code = 1
    try:
        code = become_trial(request)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


def wait_for(pid: int) -> int | None:
    """The child's exit code; None if the launcher went away first (the trial is then killed).

    Sleeps until either happens: on a pidfd (Linux >= 5.3) the child's exit wakes it at once;
    elsewhere it looks every ``POLL_S``.
    """
    try:
        exited = os.pidfd_open(pid)
    except (AttributeError, OSError):
        exited = None
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            watched = [sys.stdin] if exited is None else [sys.stdin, exited]
            readable, _, _ = select.select(watched, [], [], POLL_S if exited is None else None)
            # Readable with nothing to read: the launcher is gone (stdin's buffer is a
            # BufferedReader, typed as any binary stream).
            if sys.stdin in readable and not cast(io.BufferedReader, sys.stdin.buffer).peek(1):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return None
    finally:
        if exited is not None:
            os.close(exited)


def serve() -> int:
    # Replies go to a private copy of stdout; anything a preloaded module prints goes to stderr.
    replies = os.dup(1)
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    preload()
    reply = os.fdopen(replies, "w", buffering=1)
    reply.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in sys.stdin.buffer:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_child(request, replies)
        reply.write(json.dumps({"pid": pid}) + "\n")
        code = wait_for(pid)
        if code is None:
            return 0
        reply.write(json.dumps({"exit": code}) + "\n")
    return 0


if __name__ == "__main__":
    code = serve()
    # Nothing is left to flush (replies are line-buffered, each trial ran in a child): skipping
    # the interpreter's teardown of torch saves a closing sweep 1-2 s.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
