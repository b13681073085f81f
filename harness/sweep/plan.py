"""The Optuna side of a sweep: the study that holds the trials, its storage, and what it is told.

``search.method: grid`` is a study with a ``GridSampler``: every grid point is enqueued and
asked for in order. ``search.method: optuna`` lets a multi-objective sampler (TPE, NSGA-II,
NSGA-III, random) choose ``n_trials`` points of the same grid, one at a time, learning from
each result. Either way every trial is told real objective values when it has them, and its
memory feasibility as an Optuna constraint (``memory`` = peak / ``device_memory`` - 1, feasible
when <= 0): a trial that is ``oom`` or ``infeasible`` is a constraint violation with its
predicted or measured peak, not a failure, so the sampler learns where the memory wall is.
"""

from __future__ import annotations

import contextlib
import math
import random
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from harness.contract import Direction
from harness.record.stores import prepare_store, storage_for
from harness.spec import Spec, SpecError, SweepPlan
from harness.sweep.claim import (
    StudyAttr,
    TrialAttr,
    claim_point,
    heartbeat_options,
    owner,
    released,
    superseded,
)
from harness.trial.config import TrialConfig
from harness.trial.hardware import describe_hardware
from harness.trial.result import OVER_BUDGET, Status, TrialResult

if TYPE_CHECKING:
    from optuna import Study, Trial
    from optuna.samplers import BaseSampler


# How many times in a row a sampler may propose points already measured before one of the
# unmeasured points is taken at random instead (small categorical spaces make samplers repeat).
MAX_REPEATS = 20


def study_name(sweep: SweepPlan) -> str:
    base = f"{sweep.spec.experiment}-{sweep.grid_hash}"
    return base if sweep.spec.search.method == "grid" else f"{base}-optuna"


def spec_hash(sweep: SweepPlan) -> str:
    """The grid hash without the hardware: the same spec on any host (and the whole grid hash
    of sweeps recorded before hardware was part of a trial's identity)."""
    return replace(sweep, hardware=None).grid_hash


def swept_elsewhere(study: Study, sweep: SweepPlan) -> str | None:
    """For a new sweep: the hardware an earlier sweep of this same spec ran on, if other."""
    import optuna

    if study.get_trials(deepcopy=False):
        return None  # resuming this very sweep
    spec = sweep.spec
    mine, same_spec = dict(sweep.hardware or {}), spec_hash(sweep)
    suffix = "" if spec.search.method == "grid" else "-optuna"
    storage = storage_for(spec.tracking.storage)
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        attrs = summary.user_attrs
        if summary.study_name == study.study_name or not summary.n_trials:
            continue
        if attrs.get(StudyAttr.SPEC_HASH) == same_spec and attrs.get(StudyAttr.HARDWARE) != mine:
            return describe_hardware(attrs.get(StudyAttr.HARDWARE) or {})
        if summary.study_name == f"{spec.experiment}-{same_spec}{suffix}":
            return "hardware an earlier harness version did not record"
    return None


def free_points(study: Study, sweep: SweepPlan, keys: list[str]) -> int:
    """``--retry-failed``: the trials of these points no longer hold them (``superseded``);
    Optuna search enqueues the points, so the sampler's next trials are those points again."""
    if not keys:
        return 0
    replaced = superseded(study)
    last = max((t.number for t in study.get_trials(deepcopy=False)), default=-1)
    replaced.update({key: last for key in keys})
    study.set_user_attr(StudyAttr.SUPERSEDED, replaced)
    if sweep.spec.search.method != "grid":
        for key in keys:
            if key in sweep.by_key:
                study.enqueue_trial(sweep.by_key[key][0], skip_if_exists=False)
    return len(keys)


def restore_trials(study: Study, sweep: SweepPlan, runs: list[Any]) -> int:
    """Copy into the study every trial recorded in MLflow (``runs``: the sweep's trial runs)
    that it does not hold: its storage was deleted, emptied, or is another one (``--workers``
    keeps the study in a journal file, a plain run in SQLite). The copies are finished trials
    with the recorded point, objective values, memory constraint and status, so the planner
    counts their points as taken and a sampler learns from them as from trials it ran. How
    many were copied."""
    import optuna
    from optuna.distributions import BaseDistribution, CategoricalDistribution
    from optuna.trial import TrialState

    replaced = superseded(study)
    held = {
        t.user_attrs.get(TrialAttr.KEY)
        for t in study.get_trials(deepcopy=False)
        if TrialAttr.STATUS in t.user_attrs and not released(t, replaced)
    }
    spec, by_key = sweep.spec, sweep.by_key
    distributions: dict[str, BaseDistribution] = {
        axis: CategoricalDistribution(values) for axis, values in spec.axes().items()
    }
    copies = []
    for run in runs:
        key, status = run.data.tags.get("trial_key", ""), run.data.tags.get("status", "")
        if run.info.status == "RUNNING" or key in held or key not in by_key:
            continue
        try:
            result = TrialResult(key, Status(status), metrics=dict(run.data.metrics))
        except ValueError:  # a status this version does not know: leave the point to MLflow
            continue
        values = objective_values(spec, result)
        copies.append(
            optuna.trial.create_trial(
                state=TrialState.COMPLETE if values is not None else TrialState.FAIL,
                values=values,
                params=by_key[key][0],
                distributions=distributions,
                user_attrs={
                    TrialAttr.KEY: key,
                    TrialAttr.STATUS: status,
                    TrialAttr.RUN: run.info.run_id,
                    TrialAttr.RESTORED_FROM: "mlflow",
                },
                constraints=(
                    {"memory": memory_constraint(spec, result)} if values is not None else None
                ),
            )
        )
        held.add(key)
    if copies:
        study.add_trials(copies)
    return len(copies)


def make_sampler(spec: Spec, already: int) -> BaseSampler:
    """The spec's sampler. Its seed moves on with the study's size, so a resumed search does
    not replay the proposals its first run already made."""
    import optuna

    if spec.search.method == "grid":
        return planned_grid_sampler(spec)
    seed = spec.train.seed + already
    samplers = {
        "tpe": lambda: optuna.samplers.TPESampler(seed=seed, multivariate=True),
        "nsga2": lambda: optuna.samplers.NSGAIISampler(seed=seed, population_size=10),
        "nsga3": lambda: optuna.samplers.NSGAIIISampler(seed=seed, population_size=10),
        "random": lambda: optuna.samplers.RandomSampler(seed=seed),
    }
    return samplers[spec.search.sampler]()


def planned_grid_sampler(spec: Spec) -> BaseSampler:
    """A ``GridSampler`` for a sweep that enqueues every grid point itself.

    Optuna's ``GridSampler.after_trial`` looks for the grid id it assigns when *it* picks a
    point; enqueued points have none, and it fails when one point is left. The sweep drives
    ask/tell itself (so the sampler's "stop the study" has nothing to stop): skip that hook.
    """
    import optuna

    class PlannedGridSampler(optuna.samplers.GridSampler):
        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            return None

    return PlannedGridSampler(spec.axes(), seed=spec.train.seed)


def create_or_load(name: str, storage: Callable[[], Any], directions: list[Direction]) -> Study:
    """``create_study(load_if_exists=True)``, retried: workers starting together on a new
    PostgreSQL database race to create its tables and the study (an IntegrityError for all but
    one of them), after which loading works. ``storage()`` opens the storage (an ``RDBStorage``
    creates its tables when opened, so it is inside the race too)."""
    import optuna
    from sqlalchemy.exc import SQLAlchemyError

    for attempt in range(8):
        try:
            return optuna.create_study(
                study_name=name, storage=storage(), directions=directions, load_if_exists=True
            )
        except SQLAlchemyError:
            # The racer that won has committed by the time this one's commit failed, so
            # loading works at once; a locked SQLite file waits in its own busy timeout.
            if attempt == 7:
                raise
    raise AssertionError("unreachable")


def election_name(study_name: str) -> str:
    """The study that elects a sweep's MLflow parent run (``elect_parent``)."""
    return f"{study_name}:parent"


def elect_parent(spec: Spec, study: Study, candidate: str, alive: Callable[[str], bool]) -> str:
    """The sweep's MLflow parent run, when starts race to create one: the first candidate
    entered in the sweep's election study that is still a live run in MLflow.

    Each start that found no parent creates one (``candidate``), enters it as a waiting trial
    of the election study (point and run id in one write: Optuna numbers a study's trials
    under a lock on the study, and a journal orders them by its log), then reads every entry:
    all racers read the same order, so all choose the same run, without waiting or a clock.
    Entries whose run is gone (an MLflow store emptied while the study stayed) are passed
    over the same way by everyone. The losers delete their candidate."""
    name = election_name(study.study_name)
    election = create_or_load(name, lambda: storage_for(spec.tracking.storage), ["minimize"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # enqueue_trial's user_attrs are marked experimental
        election.enqueue_trial({}, user_attrs={"run": candidate}, skip_if_exists=False)
    for entry in sorted(election.get_trials(deepcopy=False), key=lambda t: t.number):
        run = str(entry.user_attrs.get("run") or "")
        if run == candidate or (run and alive(run)):
            return run
    return candidate  # not reached: the candidate's own entry is among them


def open_study(sweep: SweepPlan, fresh: bool = False) -> Study:
    """The sweep's study, on a storage that keeps Optuna's heartbeat where it can (an RDB
    storage: ``harness.sweep.claim``)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spec = sweep.spec
    url = spec.tracking.storage
    prepare_store(url, lambda path: optuna.storages.RDBStorage(path))
    name = study_name(sweep)
    if fresh:  # the study and its parent-run election
        for doomed in (name, election_name(name)):
            with contextlib.suppress(KeyError):
                optuna.delete_study(study_name=doomed, storage=storage_for(url))
    directions: list[Direction] = [objective.direction for objective in spec.search.objectives]
    study = create_or_load(name, lambda: storage_for(url, **heartbeat_options()), directions)
    if StudyAttr.SPEC_HASH not in study.user_attrs:  # what swept_elsewhere compares
        study.set_user_attr(StudyAttr.SPEC_HASH, spec_hash(sweep))
        study.set_user_attr(StudyAttr.HARDWARE, dict(sweep.hardware or {}))
    study.sampler = make_sampler(spec, len(study.get_trials(deepcopy=False)))
    wanted = [f"{o.metric}:{o.direction}" for o in spec.search.objectives]
    recorded = study.user_attrs.get(StudyAttr.OBJECTIVES)
    if recorded is None:
        study.set_user_attr(StudyAttr.OBJECTIVES, wanted)
    elif recorded != wanted:
        raise SpecError(
            f"{spec._source or '<spec>'}: search.objectives: {', '.join(wanted)} differ from "
            f"{', '.join(recorded)} that this sweep started with; rerun with --fresh for a new sweep"
        )
    return study


def ask(study: Study, spec: Spec, point: dict[str, Any]) -> tuple[Trial, dict[str, Any]]:
    """Start a study trial for a grid point, and return the point it really got: with other
    workers enqueueing too, ``ask`` may hand out another worker's enqueued point first."""
    study.enqueue_trial(point, skip_if_exists=False)
    trial = new_trial(study)
    return trial, suggest_point(trial, spec)


def new_trial(study: Study) -> Trial:
    """``study.ask()``, without Optuna's warning that its heartbeat is meant for
    ``Study.optimize``: this sweep drives ask/tell and records the heartbeat itself."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed")
        return study.ask()


def objective_values(spec: Spec, result: TrialResult) -> list[float] | None:
    """The values Optuna is told, or ``None`` when the trial says nothing (crash, timeout).

    A trial over the memory budget (``oom``, ``infeasible``) still has a real peak (measured
    or predicted); what it would have delivered is nothing: 0 for every maximised metric.
    An ``ok`` trial that never met its ``train.budget.target`` has no ``time_to_target_s`` or
    ``steps_to_target``: as an objective that is ``None`` too (no time reached it; any number
    put in its place would rank a miss among the trials that got there).
    """
    metrics = result.metrics
    over = result.status in OVER_BUDGET
    peak = judged_peak(metrics)
    values = []
    for objective in spec.search.objectives:
        value = metrics.get(objective.metric)
        if value is None and over:
            if objective.direction == "maximize":
                value = 0.0
            elif objective.metric.endswith("_bytes"):
                value = peak or spec.memory_budget
        if value is None or not math.isfinite(value):
            return None
        values.append(float(value))
    return values


def judged_peak(metrics: dict[str, float]) -> float | None:
    """The figure a card runs out on: measured, the allocator's reservation (CUDA) or the
    tensors' peak (CPU); predicted, the device figure (CUDA) or the allocated one (CPU)."""
    for name in (
        "peak_reserved_bytes",
        "peak_allocated_bytes",
        "predicted_device_bytes",
        "predicted_peak_bytes",
    ):
        if metrics.get(name):
            return metrics[name]
    return None


def memory_constraint(spec: Spec, result: TrialResult) -> float:
    """``peak / budget - 1``: feasible when <= 0. Over budget is always > 0."""
    peak = judged_peak(result.metrics)
    over = result.status in OVER_BUDGET
    budget = spec.memory_budget
    if budget and peak:
        violation = peak / budget - 1.0
        return max(violation, 1e-9) if over else violation
    return 1.0 if over else 0.0


def tell(study: Study, trial: Trial, spec: Spec, result: TrialResult, run_id: str) -> None:
    """Report the trial: its values and memory constraint, or FAIL when it has no values."""
    from optuna.trial import TrialState

    # (trial_key is already on the trial: claim_point named it; each write is a commit)
    trial.set_user_attr(TrialAttr.STATUS, result.status.value)
    trial.set_user_attr(TrialAttr.RUN, run_id)
    values = objective_values(spec, result)
    # skip_if_finished: a trial failed meanwhile as a dead worker's (its heartbeat lapsed) is
    # recorded in MLflow all the same; the tell must not turn that into a crash of this sweep.
    if values is None:
        study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
        return
    trial.set_constraint("memory", memory_constraint(spec, result))
    study.tell(trial, values, skip_if_finished=True)


def trials_to_run(sweep: SweepPlan, recorded: int, more: int | None) -> int:
    """Grid: every unrecorded point. Optuna: up to ``search.n_trials`` recorded in all, or
    ``more`` beyond what is recorded (``--n-trials``), never past the grid's size."""
    spec, size = sweep.spec, len(sweep.points)
    if spec.search.method == "grid":
        return size - recorded
    wanted = recorded + more if more is not None else spec.search.n_trials or 0
    return max(0, min(wanted, size) - recorded)


def suggest_point(trial: Trial, spec: Spec) -> dict[str, Any]:
    return {axis: trial.suggest_categorical(axis, values) for axis, values in spec.axes().items()}


def active_keys(study: Study) -> set[str]:
    """Points that are finished or being run by some worker (not abandoned, not dead)."""
    from optuna.trial import TrialState

    live = (TrialState.RUNNING, TrialState.COMPLETE, TrialState.FAIL)
    replaced = superseded(study)
    return {
        t.user_attrs[TrialAttr.KEY]
        for t in study.get_trials(deepcopy=False, states=live)
        if TrialAttr.KEY in t.user_attrs and not released(t, replaced)
    }


def held_by_others(study: Study) -> bool:
    """Whether another live worker is running a point of this sweep right now."""
    from optuna.trial import TrialState

    me, replaced = owner(), superseded(study)
    return any(
        t.user_attrs.get(TrialAttr.OWNER) not in (None, me) and not released(t, replaced)
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    )


class SearchPlan:
    """The trials a worker runs next: ``(optuna trial, grid point, config)`` one at a time.

    ``grid``: every point that no worker has taken, in grid order (from a random place in it
    when ``shuffle``, so parallel workers seldom reach for the same point). ``optuna``: points
    the sampler proposes until ``target`` points are taken in all; a proposal of a point
    already taken is answered with that point's recorded values at once (the sampler learns the
    same from it) and counts for nothing; after ``MAX_REPEATS`` such proposals in a row an
    untaken point is chosen at random. Every point is claimed before it is run
    (``claim.claim_point``), so racing workers never run one twice. Points noted on the study
    by ``harness sweep --top K`` (``StudyAttr.PLANNED``) come first in either, best predicted
    first (``ranks``: trial key -> its rank in the plan).
    """

    def __init__(
        self,
        study: Study,
        sweep: SweepPlan,
        recorded: set[str],
        target: int,
        shuffle: bool = False,
    ) -> None:
        spec = sweep.spec
        self.study, self.spec, self.sweep = study, spec, sweep
        self.recorded = set(recorded)
        self.target = target
        self.random = random.Random(spec.train.seed + len(recorded))
        self.by_key = {key: point for key, (point, _) in sweep.by_key.items()}
        self.shuffle = shuffle
        planned = study.user_attrs.get(StudyAttr.PLANNED) or []
        self.ranks = {str(key): int(rank) for key, rank in planned if key in self.by_key}

    def taken(self) -> set[str]:
        return self.recorded | active_keys(self.study)

    def __iter__(self) -> Iterator[tuple[Trial, dict[str, Any], TrialConfig]]:
        if self.spec.search.method == "grid":
            yield from self.grid()
            return
        for key in self.ranks:  # the plan's shortlist seeds the study
            if len(self.taken()) >= self.target:
                return
            if key not in self.taken():
                trial, point = ask(self.study, self.spec, self.by_key[key])
                config = self.sweep.trial_config(point)
                if claim_point(self.study, trial, config.trial_key):
                    yield trial, point, config
        while len(self.taken()) < self.target:
            proposal = self.propose()
            if proposal is None:
                return  # every grid point has been taken
            yield proposal

    def grid(self) -> Iterator[tuple[Trial, dict[str, Any], TrialConfig]]:
        keys = [key for key in self.by_key if key not in self.ranks]
        if self.shuffle and keys:
            start = random.Random().randrange(len(keys))
            keys = keys[start:] + keys[:start]
        keys = [*self.ranks, *keys]  # the plan's shortlist first, best predicted first
        # Passes until no point is free: two workers that claimed one point at once may both
        # have yielded it (``claim.claim_point``), and then it is free again.
        while free := [key for key in keys if key not in self.taken()]:
            taken: set[str] = set()
            for key in free:
                # A point that looked free is looked at again just before it is claimed
                # (another worker may have taken it meanwhile).
                if key in taken or key in (taken := self.taken()):
                    continue
                trial, point = ask(self.study, self.spec, self.by_key[key])
                config = self.sweep.trial_config(point)
                if claim_point(self.study, trial, config.trial_key):
                    yield trial, point, config

    def propose(self) -> tuple[Trial, dict[str, Any], TrialConfig] | None:
        for _ in range(MAX_REPEATS):
            taken = self.taken()
            if not set(self.by_key) - taken:
                return None
            trial = new_trial(self.study)
            point = suggest_point(trial, self.spec)
            config = self.sweep.trial_config(point)
            if config.trial_key in taken:
                self.repeat(trial, config.trial_key)
            elif claim_point(self.study, trial, config.trial_key):
                return trial, point, config
        untaken = [key for key in self.by_key if key not in self.taken()]
        if not untaken:
            return None
        trial, point = ask(self.study, self.spec, self.by_key[self.random.choice(untaken)])
        config = self.sweep.trial_config(point)
        if not claim_point(self.study, trial, config.trial_key):
            return self.propose()
        return trial, point, config

    def repeat(self, trial: Trial, key: str) -> None:
        """Answer a proposal of a taken point with what that point gave (if it has finished)."""
        from optuna.trial import TrialState

        replaced = superseded(self.study)
        earlier = [
            t
            for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.user_attrs.get(TrialAttr.KEY) == key and not released(t, replaced)
        ]
        trial.set_user_attr(TrialAttr.REPEAT_OF, key)
        if not earlier:
            self.study.tell(trial, state=TrialState.FAIL)
            return
        for name, value in earlier[-1].constraints.items():
            trial.set_constraint(name, value)
        self.study.tell(trial, earlier[-1].values)
