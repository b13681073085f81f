"""No orphan trial: every trial process dies with the sweep that launched it, whenever it starts.

A trial leads its own process session (so that a timeout kills its whole tree), and torchrun
starts each rank in a session of its own again, so no signal of the sweep's reaches a rank, and
killing torchrun's group does not reach them either. A rank still importing when its trial
timed out, or when the sweep died, would otherwise keep running with init as its parent, on a
GPU holding the card's memory for good. Three things close that, none needing the others:

- **The launcher's identity travels with the trial.** The launching process puts its pid and
  start time (``/proc/<pid>/stat``: a recycled pid does not count as alive) in
  ``HARNESS_LIFELINE``; torchrun passes it on to the ranks. ``hold`` (the first thing a trial
  does, before torch is imported) exits at once when that process is gone or is not the trial's
  parent or grandparent (it died and the trial was handed to init), then checks it twice a
  second from a daemon thread, with the trial's parent.
- **The kernel kills a trial whose parent dies** (``PR_SET_PDEATHSIG``, Linux): a rank dies with
  torchrun, a warm trial with its starter, at once.
- **Every process of a trial carries its tag** (``HARNESS_TRIAL_DIR``, the trial's folder, in
  its environment), so after a trial ends, however it ends, the launcher finds what is left of
  it in ``/proc/*/environ`` and kills it (``end_trial``), a rank that never reached ``hold``
  included; at its exit the launcher does the same for every trial it launched.

Standard library only: the sweep layer (the launcher) and the trial layer (``hold``) both use
it. Where there is no ``/proc`` (macOS) a launcher is alive while its pid is, the parent death
signal is not set, and nothing is found by its tag: the process group and the once-a-second
parent check are what is left there.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time
from pathlib import Path

LIFELINE_ENV = "HARNESS_LIFELINE"  # "<pid>:<start time>" of the process that launched the trial
TRIAL_ENV = "HARNESS_TRIAL_DIR"  # the trial's folder, resolved: tags every process of one trial
POLL_S = 0.5  # how often a trial looks at its launcher and its parent
END_WITHIN_S = 5.0  # how long the launcher keeps killing what a trial left behind
EXIT_CODE = 3  # a trial that outlived its launcher (torchrun reads it as a failed rank)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_PROC = Path("/proc")
_held = False


def _stat(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` from its third field on (the state); None when there is no such
    process. The name (field 2) is cut out first: it may hold spaces and parentheses."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rindex(")") + 2 :].split()


def identity(pid: int | None = None) -> str:
    """``"<pid>:<start time>"`` of ``pid`` (this process by default): the start time, in clock
    ticks since boot, tells the process from a later one given the same pid. Empty after the
    colon where there is no ``/proc``."""
    pid = os.getpid() if pid is None else pid
    fields = _stat(pid) if _PROC.is_dir() else None
    return f"{pid}:{fields[19] if fields else ''}"  # field 22 of stat: starttime


def alive(who: str) -> bool:
    """Whether the process named by ``identity`` still runs: the same pid, the same start time,
    not a zombie. Without ``/proc``, whether some process has that pid."""
    pid_text, _, start = who.partition(":")
    pid = int(pid_text)
    if not _PROC.is_dir():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process took the pid; ours is gone
            return False
        return True
    fields = _stat(pid)
    if fields is None or fields[0] in ("Z", "X", "x"):  # an exited process not yet reaped is gone
        return False
    return not start or fields[19] == start


def _parent_of(pid: int) -> int | None:
    fields = _stat(pid) if _PROC.is_dir() else None
    return int(fields[1]) if fields else None


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent (thread) ends (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _leave(why: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"harness.trial: {why}; exiting\n".encode())
    os._exit(EXIT_CODE)


def hold(poll_s: float = POLL_S) -> None:
    """Tie this trial process to its launcher and its parent: return only while both live, and
    exit (``os._exit``, no cleanup: nobody waits for this trial) as soon as either is gone.

    Call it first, before torch is imported: a rank whose trial timed out during its imports
    then never gets far, and one started after its launcher died stops at once. The parent
    check (``PR_SET_PDEATHSIG``, then the parent compared once more, since it may have died
    before the kernel was asked) covers a trial whose launcher lives but whose direct parent
    (torchrun, the warm starter) died; without ``HARNESS_LIFELINE`` (a trial run by hand) only
    that parent check is made. A second call does nothing.
    """
    global _held
    if _held:
        return
    _held = True
    launcher = os.environ.get(LIFELINE_ENV, "")
    if launcher and not alive(launcher):
        _leave(f"the sweep that launched this trial ({LIFELINE_ENV}={launcher}) is gone")
    _die_with_parent()
    parent = os.getppid()
    if launcher and not _descends_from(int(launcher.partition(":")[0]), parent):
        _leave(f"this trial's parent died before it started (now {parent})")

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                _leave("this trial's parent process is gone")
            if launcher and not alive(launcher):
                _leave("the sweep that launched this trial is gone")

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def _descends_from(launcher: int, parent: int) -> bool:
    """Whether ``parent`` is the launcher or a child of it (torchrun, the warm starter): if it
    is neither, the real parent died and this process was handed to init (or a subreaper).
    True where that cannot be told (no ``/proc``)."""
    if parent == launcher or not _PROC.is_dir():
        return True
    return _parent_of(parent) == launcher


def trial_environment(workdir: Path) -> dict[str, str]:
    """What the launcher adds to a trial's environment: its own identity and the trial's tag."""
    return {LIFELINE_ENV: identity(), TRIAL_ENV: str(workdir.resolve())}


def carrying(name: str, value: str) -> list[int]:
    """Pids of this user's processes (other than this one) whose environment, as they were
    started, holds ``name=value``; empty where there is no ``/proc``.

    A process started by ``exec`` carries its environment there, and so do its forks; a change
    made later (``os.environ`` in a warm trial forked from the starter) does not show, which is
    why a warm trial is killed by its process group instead."""
    if not _PROC.is_dir():
        return []
    entry, own, found = f"{name}={value}".encode(), os.getpid(), []
    for name_ in os.listdir(_PROC):
        if not name_.isdigit() or int(name_) == own:
            continue
        try:
            environ = (_PROC / name_ / "environ").read_bytes()
        except OSError:  # gone meanwhile, or another user's
            continue
        if entry in environ.split(b"\0"):
            found.append(int(name_))
    return found


def end_carrying(name: str, value: str, within_s: float = END_WITHIN_S) -> list[int]:
    """SIGKILL every process carrying ``name=value``, again until none is left (a process being
    killed may still fork, a dying one may take a moment to go) or ``within_s`` has passed; the
    pids killed. A process that has exited shows an empty environment, so a zombie is not
    waited for."""
    deadline, killed = time.monotonic() + within_s, []
    while pids := carrying(name, value):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return killed


def end_trial(workdir: Path, within_s: float = END_WITHIN_S) -> list[int]:
    """Kill whatever is left of the trial run in ``workdir`` (its tag); the pids killed."""
    return end_carrying(TRIAL_ENV, str(workdir.resolve()), within_s)


_ending_at_exit = False


def end_launched_at_exit() -> None:
    """At this process's exit, kill every process still carrying its identity: whatever any
    trial it launched left (a trial ended normally leaves nothing; this is the last net)."""
    global _ending_at_exit
    if not _ending_at_exit:
        _ending_at_exit = True
        atexit.register(end_carrying, LIFELINE_ENV, identity(), 2.0)
