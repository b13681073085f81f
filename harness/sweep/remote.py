"""What the cluster launchers (``--launcher slurm``, ``--launcher ray``) share.

Both hand the sweep to a scheduler the cluster already runs: it starts N workers, each the same
loop as ``harness worker`` (``harness.sweep.run.run_worker``) in a process of its own on some
node, and they share one study and one tracking server through the claim protocol
(``harness.sweep.claim``), so every point runs exactly once whichever worker takes it and a lost
worker's point runs again. This module checks the stores before anything is submitted (from
here, and that they are not paths of this host only), makes the MLflow experiment before the
workers race to, hands the stores to the workers by environment (never a command line: a
password in a URL would show in ``ps``), and watches the study for ``--wait``.

The workers resolve their own hardware, and a trial's identity includes it, so the study they
use is named on the nodes, not here: each submission has an id (``HARNESS_LAUNCH``) that its
workers note on the study they join (``claim.StudyAttr.LAUNCH``), and the watch finds the study by it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from harness.contract import LAUNCH_ENV, STORAGE_ENV, TRACKING_ENV
from harness.record.stores import shared_storage, storage_for
from harness.record.tracking import Tracker
from harness.spec import Spec, SpecError, points
from harness.sweep import preflight
from harness.sweep.claim import StudyAttr, TrialAttr, released, superseded
from harness.sweep.launcher import LaunchOutcome
from harness.sweep.prepare import with_tracking
from harness.sweep.workers import gpus_per_worker
from harness.waiting import until

if TYPE_CHECKING:
    from optuna import Study


POLL_S = 2.0


def require(package: str, extra: str) -> Any:
    """Import a launcher's package, or one line saying how to install it (exit 2)."""
    try:
        return importlib.import_module(package)
    except ImportError:
        raise SpecError(
            f"--launcher {extra} needs the {package} package: pip install 'harness[{extra}]'"
        ) from None


def new_launch_id() -> str:
    return uuid.uuid4().hex[:12]


def prepare_launch(spec: Spec, launcher: str) -> Spec:
    """Check the stores from here and that every node can reach them; make the experiment.

    A SQLite study storage on a shared filesystem becomes a journal file beside it (SQLite is
    not safe for concurrent writers), as with ``--workers``."""
    preflight.check_stores(spec)
    preflight.check_shared_stores(spec, launcher)
    spec = with_tracking(spec, storage=shared_storage(spec.tracking.storage))
    # Before the workers start: racing to create the experiment fails all but one of them.
    results = Path(spec.tracking.results_dir)
    Tracker(spec.tracking.mlflow_uri, spec.experiment, results / "mlartifacts" / spec.experiment)
    return spec


def worker_settings(spec: Spec, launch: str) -> dict[str, str]:
    """What a worker reads from its environment: the stores and the submission's id."""
    return {
        STORAGE_ENV: spec.tracking.storage,
        TRACKING_ENV: spec.tracking.mlflow_uri,
        LAUNCH_ENV: launch,
    }


@contextlib.contextmanager
def worker_environment(settings: dict[str, str]) -> Iterator[None]:
    """``settings`` in this process's environment while the block submits: the scheduler
    copies it into the jobs (sbatch exports the submitting environment by default, submitit's
    local executor starts its jobs with it). Restored afterwards."""
    before = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def gpus_needed(spec: Spec) -> int:
    """GPUs one worker asks the scheduler for: its largest trial's world size; none for
    ``device: cpu``."""
    return 0 if spec.device == "cpu" else gpus_per_worker(spec)


def trials_wanted(spec: Spec) -> int:
    """How many trials the sweep records: every grid point, or ``search.n_trials``."""
    size = len(points(spec))
    return size if spec.search.method == "grid" else min(size, spec.search.n_trials or size)


def spec_path(spec: Spec) -> str:
    """The spec file, absolute: the workers read it (from a filesystem they share with this
    host, as `harness worker` on every node does)."""
    if not spec._source or not Path(spec._source).is_file():
        raise SpecError(f"{spec._source or '<spec>'}: a launcher's workers read the spec file")
    return str(Path(spec._source).resolve())


class StudyWatch:
    """The studies a submission's workers joined, and how far they are."""

    def __init__(self, spec: Spec, launch: str) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage = storage_for(spec.tracking.storage)
        self.storage = optuna.storages.RDBStorage(storage) if isinstance(storage, str) else storage
        self.attr = f"{StudyAttr.LAUNCH}{launch}"
        self.studies: dict[str, Study] = {}

    def find(self) -> list[Study]:
        import optuna

        for summary in optuna.get_all_study_summaries(self.storage, include_best_trial=False):
            if self.attr in summary.user_attrs and summary.study_name not in self.studies:
                self.studies[summary.study_name] = optuna.load_study(
                    study_name=summary.study_name, storage=self.storage
                )
        return list(self.studies.values())

    def counts(self) -> tuple[int, int]:
        """Trials recorded and trials running, over the studies found."""
        from optuna.trial import TrialState

        recorded = running = 0
        for study in self.find():
            replaced = superseded(study)
            for trial in study.get_trials(deepcopy=False):
                if TrialAttr.KEY not in trial.user_attrs or released(trial, replaced):
                    continue
                if trial.state == TrialState.RUNNING:
                    running += 1
                elif TrialAttr.STATUS in trial.user_attrs:
                    recorded += 1
        return recorded, running

    def parents(self) -> list[str]:
        """The MLflow parent runs of the studies found (one per hardware the workers had)."""
        return [
            study.user_attrs[StudyAttr.PARENT]
            for study in self.find()
            if StudyAttr.PARENT in study.user_attrs
        ]


def watch(
    console: Console,
    label: str,
    study: StudyWatch,
    alive: Callable[[], int],
    workers: int,
    total: int,
) -> None:
    """A line each time the picture changes, until no worker is left running."""
    shown = {"line": "", "recorded": 0, "running": 0}

    def done() -> bool:
        running_workers = alive()
        with contextlib.suppress(Exception):  # a store hiccup costs one line, not the watch
            shown["recorded"], shown["running"] = study.counts()
        line = (
            f"{label}: {running_workers} of {workers} worker(s) running; "
            f"{shown['recorded']}/{total} trial(s) recorded, {shown['running']} running"
        )
        if line != shown["line"]:
            console.print(line, highlight=False, markup=False)
            shown["line"] = line
        return not running_workers

    until(done, every_s=POLL_S, what=f"the {label} workers")


def finish(outcome: LaunchOutcome, spec: Spec, study: StudyWatch) -> LaunchOutcome:
    """Fill in what the workers recorded once they are done: parent runs, missing trials."""
    results = Path(spec.tracking.results_dir)
    tracker = Tracker(
        spec.tracking.mlflow_uri, spec.experiment, results / "mlartifacts" / spec.experiment
    )
    outcome.parents = study.parents()
    outcome.missing = sum(
        max(0, outcome.total - len(tracker.recorded_trials(parent))) for parent in outcome.parents
    )
    if not outcome.parents:
        outcome.missing = outcome.total
    return outcome


def first_line(error: BaseException, kind: bool = True) -> str:
    """The first line of an error's message (after its type's name, with ``kind``)."""
    text = str(error).strip().splitlines()
    if not text:
        return type(error).__name__
    return f"{type(error).__name__}: {text[0]}" if kind else text[0]
