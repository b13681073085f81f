"""Several sweep processes, one study: storage, claiming a point, heartbeats, dead workers.

Every worker (``harness sweep``, each of ``--workers N``, each ``harness worker`` on any host)
opens the same Optuna study and takes grid points one at a time:

- **Claim.** A worker asks the study for a trial, names its point (``trial_key``) on it, then
  looks at every other trial of that point: one that is finished (and not abandoned) or an
  earlier one still running means the point is taken, and the worker abandons its trial and
  moves on. Both of two racing workers name their point before they look, so the one whose
  trial came first keeps it and the other sees it: every point runs once.
- **Heartbeat.** While its trial runs, a worker writes the time onto the trial every
  ``HEARTBEAT_S`` seconds, with its owner (``host:pid``).
- **Dead workers.** A running trial whose owner is a dead process on this host, or whose
  heartbeat is older than ``STALE_AFTER_S``, is failed and its point is free again. Such a
  trial is told apart from a measured failure without any private Optuna API: ``plan.tell``
  writes the trial's ``status`` before it fails a trial, a dead worker's trial never got one.
- **Retried.** ``harness sweep --retry-failed`` records on the study which trials of which
  points it replaces (``superseded``): those points are free again, their MLflow runs are
  deleted (kept in the store, restorable) and tagged ``superseded``.

The heartbeat is this module's own (a user attribute), not Optuna's RDB heartbeat: that one is
written through a storage call that needs a trial's private id, and journal files have none.

Storage (``harness.record.stores``): ``sqlite:///...`` (one process at a time is safest),
``journal:PATH`` (Optuna's journal file: many processes on one machine) or
``postgresql://...`` (many machines).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

HEARTBEAT_S = 5.0
STALE_AFTER_S = 60.0


def owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_stale(trial: Any, now: float) -> bool:
    """A RUNNING trial nobody is working on any more."""
    holder = trial.user_attrs.get("owner")
    if holder is None:  # written before owners existed: a single sweep that was killed
        return True
    host, _, pid = holder.rpartition(":")
    if holder == owner():
        return False
    if host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
        return True
    beat = trial.user_attrs.get("heartbeat")
    if beat is None and trial.datetime_start is not None:
        beat = trial.datetime_start.timestamp()
    return beat is None or now - float(beat) > STALE_AFTER_S


def fail_stale_trials(study: Any) -> int:
    """Fail the RUNNING trials of dead workers, so their points run again."""
    from optuna.trial import TrialState

    now = time.time()
    stale = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if is_stale(t, now)
    ]
    for trial in stale:
        with contextlib.suppress(Exception):  # another worker may have failed it just now
            study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
    return len(stale)


SUPERSEDED_ATTR = "superseded"  # on the study: trial_key -> last trial number a retry replaced


def superseded(study: Any) -> dict[str, int]:
    """Which trials ``--retry-failed`` replaced: per point, the last trial number it replaced
    (a study attribute: a finished trial's own attributes cannot be written any more)."""
    return dict(study.user_attrs.get(SUPERSEDED_ATTR, {}))


def released(trial: Any, replaced: dict[str, int]) -> bool:
    """Whether a study trial no longer holds its point (see the module notes): a repeat of a
    taken point, abandoned at its claim, replaced by a retry (``replaced``: ``superseded``),
    or a dead worker's (failed without the status ``plan.tell`` writes first; ``stale`` on
    studies written before)."""
    from optuna.trial import TrialState

    attrs = trial.user_attrs
    if "repeat_of" in attrs or attrs.get("abandoned") or attrs.get("stale"):
        return True
    if trial.number <= replaced.get(attrs.get("trial_key", ""), -1):
        return True
    return trial.state == TrialState.FAIL and "status" not in attrs


def taken(study: Any, trial: Any, key: str) -> bool:
    """Whether another trial already has this point (see the module notes)."""
    from optuna.trial import TrialState

    replaced = superseded(study)
    for other in study.get_trials(deepcopy=False):
        attrs = other.user_attrs
        if other.number == trial.number or attrs.get("trial_key") != key:
            continue
        if released(other, replaced):
            continue
        if other.state == TrialState.RUNNING and other.number < trial.number:
            return True
        if other.state in (TrialState.COMPLETE, TrialState.FAIL):
            return True
    return False


def claim_point(study: Any, trial: Any, key: str) -> bool:
    """Name the point on the trial, then keep it only if nobody else has it."""
    from optuna.trial import TrialState

    trial.set_user_attr("trial_key", key)
    trial.set_user_attr("owner", owner())
    trial.set_user_attr("heartbeat", time.time())
    if not taken(study, trial, key):
        return True
    trial.set_user_attr("abandoned", True)
    study.tell(trial, state=TrialState.FAIL)
    return False


@contextlib.contextmanager
def heartbeat(trial: Any) -> Iterator[None]:
    """Write the time onto the trial every ``HEARTBEAT_S`` while the block runs."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            with contextlib.suppress(Exception):  # a storage hiccup must not kill the trial
                trial.set_user_attr("heartbeat", time.time())

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
