"""Several sweep processes, one study: storage, claiming a point, heartbeats, dead workers.

Every worker (``harness sweep``, each of ``--workers N``, each ``harness worker`` on any host,
each Slurm job or Ray actor of ``--launcher``) opens the same Optuna study and takes grid
points one at a time:

- **Claim.** A worker asks the study for a trial, names its point (``trial_key``) on it, then
  looks at every other trial of that point: any other that is running or finished (and not
  abandoned or a dead worker's) means the point is taken, and the worker abandons its trial
  and moves on. Each of two racing workers names the point before it looks, so whichever
  looks last sees the other and yields: two never keep one point. Both may yield, when both
  named it before either looked; the point is then free again and the next look takes it
  (``plan.SearchPlan`` looks until no point is free). The trials' numbers cannot decide
  instead: an earlier-numbered trial may name the point after a later one has looked and
  kept it. Optuna has nothing for this (its ``GridSampler`` hands the same point to racing
  workers, and a failed point is never retried), so the claim is ours.
- **Heartbeat.** While its trial runs, a worker proves it is alive every ``HEARTBEAT_S``
  seconds. On an RDB storage (PostgreSQL, MySQL, SQLite) that is **Optuna's own heartbeat**:
  the storage is opened with ``heartbeat_interval``/``grace_period`` and a stale-trial
  callback (``heartbeat_options``), the worker records beats with the storage's public
  ``record_heartbeat`` (the trial's id found through the public
  ``get_trial_id_from_study_id_trial_number``: Optuna beats by itself only inside
  ``Study.optimize``, and this sweep drives ask/tell), and ``optuna.storages.fail_stale_trials``
  fails trials whose beat is older than the grace period, timed by the database's clock, so
  hosts with skewed clocks agree. A journal file has no heartbeat in Optuna, so there the
  worker writes the time as a user attribute (``heartbeat``) and this module judges it.
- **Dead workers.** A running trial whose heartbeat lapsed (above), or whose owner
  (``host:pid``, written at the claim) is a dead process on this host (Optuna cannot know
  that: a killed worker's point runs again at once instead of after the grace period), is
  failed and its point is free again. Such a trial is told apart from a measured failure
  without any private Optuna API: ``plan.tell`` writes the trial's ``status`` before it fails
  a trial, a dead worker's trial never got one.
- **Retried.** ``harness sweep --retry-failed`` records on the study which trials of which
  points it replaces (``superseded``): those points are free again, their MLflow runs are
  deleted (kept in the store, restorable) and tagged ``superseded``.

Optuna's ``RetryHeartbeatStaleTrialCallback`` is not used: it enqueues a copy of the stale
trial that the next ``ask`` of any worker would pop, beside the point this sweep's planner
frees and enqueues itself; the callback here only says what happened.

Storage (``harness.record.stores``): ``sqlite:///...`` (one process at a time is safest),
``journal:PATH`` (Optuna's journal file: many processes on one machine, or on a shared
filesystem) or ``postgresql://...`` (many machines).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from optuna import Study, Trial
    from optuna.trial import FrozenTrial

# Optuna takes heartbeat_interval and grace_period in whole seconds (heartbeat_options).
HEARTBEAT_S: float = 5
STALE_AFTER_S: float = 60
# How often a worker with nothing left to take re-reads whether the others are done: the sweep
# ends this long at most after its last trial (one small read of the running trials each time).
OTHERS_DONE_POLL_S: float = 1


class TrialAttr:
    """The names the protocol writes on a study trial (``user_attrs``): this module, ``plan``
    and ``remote`` read them from here, never as bare strings."""

    KEY = "trial_key"  # the point's trial_key, named at the claim
    OWNER = "owner"  # host:pid of the worker that claimed it
    HEARTBEAT = "heartbeat"  # the last beat's time, where the storage keeps no Optuna heartbeat
    OPTUNA_BEAT = "optuna_heartbeat"  # liveness kept by Optuna's heartbeat: its age is Optuna's
    ABANDONED = "abandoned"  # saw another trial of the point at its claim, and yielded
    STALE = "stale"  # a dead worker's, on studies written before ``status`` told them apart
    STATUS = "status"  # the trial's status, written by ``plan.tell`` before the study is told
    RUN = "mlflow_run_id"  # the trial's MLflow run
    REPEAT_OF = "repeat_of"  # a sampler's proposal of a taken point, answered with its values
    RESTORED_FROM = "restored_from"  # copied into the study from the record (``mlflow``)


class StudyAttr:
    """The names written on the study itself."""

    PARENT = "mlflow_parent_run_id"  # the sweep's MLflow parent run
    SUPERSEDED = "superseded"  # trial_key -> last trial number a retry replaced
    SPEC_HASH = "spec_hash"  # the grid hash without the hardware (``plan.swept_elsewhere``)
    HARDWARE = "hardware"  # the hardware the sweep is keyed to
    OBJECTIVES = "objectives"  # metric:direction, as the sweep started
    LAUNCH = "launch_"  # + a ``--launcher`` submission's id: its workers joined this study
    PLANNED = "planned_first"  # [trial_key, predicted rank] that run first (``sweep --top``)


# How many trials this process failed through Optuna's stale-trial callback (``report_stale``).
_stale_reported = 0


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


def report_stale(study: Study, trial: FrozenTrial) -> None:
    """Optuna's stale-trial callback: one line naming the point whose worker went silent."""
    global _stale_reported
    _stale_reported += 1
    key = str(trial.user_attrs.get(TrialAttr.KEY, "?"))[:8]
    holder = trial.user_attrs.get(TrialAttr.OWNER, "an unknown worker")
    print(
        f"trial {trial.number} (point {key}, worker {holder}) sent no heartbeat for "
        f"{STALE_AFTER_S:g}s: failed, its point runs again",
        file=sys.stderr,
        flush=True,
    )


def heartbeat_options() -> dict[str, Any]:
    """What ``harness.record.stores.storage_for`` opens an RDB storage with: Optuna's heartbeat."""
    return {
        "heartbeat_s": max(1, round(HEARTBEAT_S)),
        "grace_s": max(1, round(STALE_AFTER_S)),
        "on_stale": report_stale,
    }


def optuna_beat(trial: Trial) -> Callable[[], None] | None:
    """A call that records one Optuna heartbeat of ``trial``, or None where its storage keeps
    none (journal files, in-memory studies). Public API only: ``optuna.Trial.storage``, the
    storage's ``get_heartbeat_interval``/``record_heartbeat`` and its id lookups."""
    storage = getattr(trial, "storage", None)
    interval = getattr(storage, "get_heartbeat_interval", None)
    if storage is None or interval is None or not interval():
        return None
    study_id = storage.get_study_id_from_name(trial.study.study_name)
    trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
    return lambda: storage.record_heartbeat(trial_id)


def is_stale(trial: FrozenTrial, now: float) -> bool:
    """A RUNNING trial nobody is working on any more (by the checks Optuna cannot make)."""
    attrs = trial.user_attrs
    holder = attrs.get(TrialAttr.OWNER)
    if holder is None:
        if TrialAttr.KEY in attrs:  # written before owners existed: a single sweep that was killed
            return True
        # Asked but not claimed yet: its worker may be between ask and claim right now.
        start = trial.datetime_start
        return start is None or now - start.timestamp() > STALE_AFTER_S
    host, _, pid = holder.rpartition(":")
    if holder == owner():
        return False
    if host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
        return True
    if attrs.get(TrialAttr.OPTUNA_BEAT):
        return False  # Optuna's heartbeat: optuna.storages.fail_stale_trials judges its age
    beat = attrs.get(TrialAttr.HEARTBEAT)
    if beat is None and trial.datetime_start is not None:
        beat = trial.datetime_start.timestamp()
    return beat is None or now - float(beat) > STALE_AFTER_S


def fail_stale_trials(study: Study) -> int:
    """Fail the RUNNING trials of dead workers, so their points run again: Optuna's own check
    of its heartbeat first (a no-op on storages without one), then ``is_stale``'s."""
    import optuna
    from optuna.trial import TrialState

    before = _stale_reported
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    now = time.time()
    stale = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if is_stale(t, now)
    ]
    for trial in stale:
        with contextlib.suppress(Exception):  # another worker may have failed it just now
            study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
    return len(stale) + _stale_reported - before


def superseded(study: Study) -> dict[str, int]:
    """Which trials ``--retry-failed`` replaced: per point, the last trial number it replaced
    (a study attribute: a finished trial's own attributes cannot be written any more)."""
    return dict(study.user_attrs.get(StudyAttr.SUPERSEDED, {}))


def released(trial: FrozenTrial, replaced: dict[str, int]) -> bool:
    """Whether a study trial no longer holds its point (see the module notes): a repeat of a
    taken point, abandoned at its claim, replaced by a retry (``replaced``: ``superseded``),
    or a dead worker's (failed without the status ``plan.tell`` writes first; ``stale`` on
    studies written before)."""
    from optuna.trial import TrialState

    attrs = trial.user_attrs
    if TrialAttr.REPEAT_OF in attrs or attrs.get(TrialAttr.ABANDONED) or attrs.get(TrialAttr.STALE):
        return True
    if trial.number <= replaced.get(attrs.get(TrialAttr.KEY, ""), -1):
        return True
    return trial.state == TrialState.FAIL and TrialAttr.STATUS not in attrs


def taken(study: Study, trial: Trial, key: str) -> bool:
    """Whether another trial already has this point (see the module notes)."""
    from optuna.trial import TrialState

    replaced = superseded(study)
    for other in study.get_trials(deepcopy=False):
        attrs = other.user_attrs
        if other.number == trial.number or attrs.get(TrialAttr.KEY) != key:
            continue
        if released(other, replaced):
            continue
        if other.state in (TrialState.RUNNING, TrialState.COMPLETE, TrialState.FAIL):
            return True  # running: it named the point first, or will see this one and yield
    return False


def cut_off_before(study: Study, trial: Trial, key: str) -> bool:
    """Whether a dead worker held this point before ``trial`` (failed without a status, as
    ``fail_stale_trials`` leaves it): it may have died while recording it in MLflow."""
    from optuna.trial import TrialState

    for other in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)):
        attrs = other.user_attrs
        if other.number == trial.number or attrs.get(TrialAttr.KEY) != key:
            continue
        if (
            TrialAttr.STATUS not in attrs
            and TrialAttr.REPEAT_OF not in attrs
            and not attrs.get(TrialAttr.ABANDONED)
        ):
            return True
    return False


def claim_point(study: Study, trial: Trial, key: str) -> bool:
    """Name the point on the trial, then keep it only if nobody else has it.

    The first heartbeat comes before the owner and the owner before the point, so a trial
    holding a point always has an owner whose death can be seen, and a beat Optuna can age."""
    from optuna.trial import TrialState

    beat = optuna_beat(trial)
    if beat is not None:
        beat()
        trial.set_user_attr(TrialAttr.OPTUNA_BEAT, True)
    else:
        trial.set_user_attr(TrialAttr.HEARTBEAT, time.time())
    trial.set_user_attr(TrialAttr.OWNER, owner())
    trial.set_user_attr(TrialAttr.KEY, key)
    if not taken(study, trial, key):
        return True
    trial.set_user_attr(TrialAttr.ABANDONED, True)
    study.tell(trial, state=TrialState.FAIL)
    return False


@contextlib.contextmanager
def heartbeat(trial: Trial) -> Iterator[None]:
    """Prove every ``HEARTBEAT_S`` that the trial's worker is alive while the block runs:
    Optuna's heartbeat where the storage keeps one, else the time as a user attribute."""
    beat = optuna_beat(trial)

    def write() -> None:
        if beat is not None:
            beat()
        else:
            trial.set_user_attr(TrialAttr.HEARTBEAT, time.time())

    stop = threading.Event()

    def beats() -> None:
        while not stop.wait(HEARTBEAT_S):
            with contextlib.suppress(Exception):  # a storage hiccup must not kill the trial
                write()

    thread = threading.Thread(target=beats, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
