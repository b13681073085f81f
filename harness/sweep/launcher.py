"""What every way of starting a sweep's workers shares: one request, one outcome, one interface.

``harness sweep`` hands a ``LaunchRequest`` to the ``Launcher`` its spec and options name
(``harness.sweep.launchers.launcher_for``): ``local`` (this process), ``workers`` (``--workers
N`` processes on this host), ``slurm`` (a submitit job array) or ``ray`` (Ray actors). Each
returns a ``LaunchOutcome``; the command reports every one the same way. The workers
themselves all run ``harness.sweep.run.run_worker`` (or, local, the same loop in-process).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rich.console import Console

    from harness.spec import Spec


@dataclass(frozen=True)
class LaunchRequest:
    """The spec and what the command line asked of the sweep (checked before a launch:
    ``harness.cli.run``)."""

    spec: Spec
    console: Console
    fresh: bool = False
    more_trials: int | None = None  # --n-trials
    retry: str | None = None  # --retry-failed: failed | all
    workers: int = 1  # --workers (local only)
    wait: bool = False  # --wait (slurm: follow the jobs; the others always wait)
    top: int | None = None  # --top K: the K best predicted points first (this host only)


@dataclass
class LaunchOutcome:
    """What a launch did: its workers (job ids, actors) and, when it was waited for, what
    they recorded."""

    launcher: str
    experiment: str
    tracking_uri: str
    workers: list[str]
    waited: bool
    total: int  # trials the sweep records in all (per hardware the workers ran on)
    parents: list[str] = field(default_factory=list)  # the MLflow parent runs they recorded in
    missing: int = 0  # trials of those sweeps with no record when the workers were done
    problems: list[str] = field(default_factory=list)  # one line per worker that ended badly
    hints: list[str] = field(default_factory=list)  # how to follow a sweep not waited for


@dataclass
class SweepOutcome:
    """One process's part of a sweep: the parent run it recorded in, how many trials the
    sweep has in all and how many were recorded before it began."""

    experiment: str
    parent_run_id: str
    total: int
    already_recorded: int


class Launcher(Protocol):
    """One way of starting a sweep's workers."""

    name: str
    # Said after "Interrupted. Finished trials are recorded; " when Ctrl-C or SIGTERM stops
    # the launch; None where the launcher has said what happens itself.
    resume_hint: str | None

    def launch(self, request: LaunchRequest) -> LaunchOutcome: ...


class OnThisHost:
    """A launcher whose workers are this host's processes, waited for here (``local``,
    ``workers``): the sweep's one parent run is its outcome."""

    name: str = ""
    resume_hint: str | None = "run the same command to resume"

    def run(self, request: LaunchRequest) -> SweepOutcome:
        raise NotImplementedError

    def launch(self, request: LaunchRequest) -> LaunchOutcome:
        outcome = self.run(request)
        uri = request.spec.tracking.mlflow_uri
        parents = [outcome.parent_run_id]
        return LaunchOutcome(self.name, outcome.experiment, uri, [], True, outcome.total, parents)
