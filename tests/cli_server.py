"""A fork server for the tests' ``harness`` commands: ``python -m harness ARGS`` without paying
the command's imports again each time.

Why: on this project's 2-core CI machine a ``harness`` process spends 3-6 s of CPU importing
click, pandas, MLflow and Optuna before it does anything, and the suite runs that command a few
hundred times; that alone was a third of its CPU time. This server imports them once, then
forks one child per command. The child is a fresh process as far as the command can tell: its
own pid and process group, the working directory, environment, argv and ``sys.path[0]`` that
``python -m harness`` would have in that directory, stdin from /dev/null, stdout and stderr
into files, the interpreter's own exit sequence (non-daemon threads joined, atexit handlers
run). What it shares with the server is only modules already imported, which read nothing
from the environment at import time (``harness.cli`` and the libraries; never ``harness``'s
torch-side layers, which do). ``HARNESS_TEST_FORK=0`` runs every command as a plain
subprocess instead.

Protocol, a JSON line each way: request ``{argv, cwd, env, stdout, stderr}`` (file paths);
answers ``{"pid": N}`` when the child runs, then ``{"code": C}`` (a negative C: killed by
signal -C, as ``subprocess`` reports it).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import signal
import sys
import threading
import traceback
from typing import Any

PRELOADED = (
    "harness.cli.main",
    "mlflow",
    "mlflow.tracking",
    "mlflow.store.tracking.sqlalchemy_store",
    "optuna",
    "optuna.storages._rdb.storage",
)


def _exit_code(error: SystemExit) -> int:
    """What the interpreter makes of ``SystemExit(code)`` (None: 0; a text: printed, 1)."""
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def _child(request: dict[str, Any]) -> None:
    """Become ``python -m harness ARGV`` in the request's directory; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd, path, flags in (
            (0, os.devnull, os.O_RDONLY),
            (1, request["stdout"], os.O_WRONLY | os.O_TRUNC | os.O_CREAT),
            (2, request["stderr"], os.O_WRONLY | os.O_TRUNC | os.O_CREAT),
        ):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = os.getcwd()  # what `python -m` puts first
        sys.argv = ["harness", *request["argv"]]
        try:
            runpy.run_module("harness", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as error:
            code = _exit_code(error)
        except KeyboardInterrupt:
            traceback.print_exc()
            code = 130
        except BaseException:  # printed as the interpreter prints it
            traceback.print_exc()
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream: nothing more to say
                stream.flush()
        os._exit(code)


def serve() -> None:
    from harness.record.stores import quiet_mlflow

    quiet_mlflow()  # as the command does before its first MLflow import (telemetry off)
    for name in PRELOADED:
        __import__(name)
    # A fork copies only the forking thread, and torch's state would make every command look
    # like one that imported torch (the layering says the command never does): refuse both.
    if threading.active_count() != 1 or "torch" in sys.modules:
        sys.exit(
            f"cli_server: after its imports, {threading.active_count()} threads and torch"
            f" {'imported' if 'torch' in sys.modules else 'not imported'}: cannot fork"
        )
    answers = sys.stdout
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), file=answers, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), file=answers, flush=True)


if __name__ == "__main__":
    serve()
