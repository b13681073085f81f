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
from collections.abc import Iterator
from typing import Any

from harness.spec import Spec, SpecError
from harness.tracking import prepare_store
from harness.trial.config import TrialConfig

# Statuses whose trial still says something about the search space (with fallback values).
OVER_BUDGET = ("oom", "infeasible")
# How many times in a row a sampler may propose points already measured before one of the
# unmeasured points is taken at random instead (small categorical spaces make samplers repeat).
MAX_REPEATS = 20


def study_name(spec: Spec) -> str:
    base = f"{spec.experiment}-{spec.grid_hash()}"
    return base if spec.search.method == "grid" else f"{base}-optuna"


def make_sampler(spec: Spec, already: int) -> Any:
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


def planned_grid_sampler(spec: Spec) -> Any:
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


def open_study(spec: Spec, fresh: bool = False) -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    prepare_store(spec.tracking.storage)
    name = study_name(spec)
    if fresh:
        with contextlib.suppress(KeyError):
            optuna.delete_study(study_name=name, storage=spec.tracking.storage)
    directions = [objective.direction for objective in spec.search.objectives]
    study = optuna.create_study(
        study_name=name,
        storage=spec.tracking.storage,
        directions=directions,
        load_if_exists=True,
    )
    study.sampler = make_sampler(spec, len(study.get_trials(deepcopy=False)))
    wanted = [f"{o.metric}:{o.direction}" for o in spec.search.objectives]
    recorded = study.user_attrs.get("objectives")
    if recorded is None:
        study.set_user_attr("objectives", wanted)
    elif recorded != wanted:
        raise SpecError(
            f"{spec._source or '<spec>'}: search.objectives: {', '.join(wanted)} differ from "
            f"{', '.join(recorded)} that this sweep started with; rerun with --fresh for a new sweep"
        )
    return study


def fail_stale_trials(study: Any) -> int:
    """Trials left RUNNING by a sweep that was killed: mark them failed so their point re-runs."""
    from optuna.trial import TrialState

    stale = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    for trial in stale:
        study.tell(trial.number, state=TrialState.FAIL)
    return len(stale)


def ask(study: Any, spec: Spec, point: dict[str, Any]) -> Any:
    """Start the study's trial for one grid point."""
    study.enqueue_trial(point, skip_if_exists=False)
    trial = study.ask()
    for axis, values in spec.axes().items():
        trial.suggest_categorical(axis, values)
    return trial


def objective_values(spec: Spec, result: dict[str, Any]) -> list[float] | None:
    """The values Optuna is told, or ``None`` when the trial says nothing (crash, timeout).

    A trial over the memory budget (``oom``, ``infeasible``) still has a real peak (measured
    or predicted); what it would have delivered is nothing: 0 for every maximised metric.
    """
    metrics = result.get("metrics", {})
    over = result["status"] in OVER_BUDGET
    peak = metrics.get("peak_allocated_bytes") or metrics.get("predicted_peak_bytes")
    values = []
    for objective in spec.search.objectives:
        value = metrics.get(objective.metric)
        if value is None and over:
            if objective.direction == "maximize":
                value = 0.0
            elif objective.metric.endswith("_bytes"):
                value = peak or spec.device_memory
        if value is None or not math.isfinite(value):
            return None
        values.append(float(value))
    return values


def memory_constraint(spec: Spec, result: dict[str, Any]) -> float:
    """``peak / device_memory - 1``: feasible when <= 0. Over budget is always > 0."""
    metrics = result.get("metrics", {})
    peak = metrics.get("peak_allocated_bytes") or metrics.get("predicted_peak_bytes")
    over = result["status"] in OVER_BUDGET
    if spec.device_memory and peak:
        violation = peak / spec.device_memory - 1.0
        return max(violation, 1e-9) if over else violation
    return 1.0 if over else 0.0


def tell(study: Any, trial: Any, spec: Spec, result: dict[str, Any], run_id: str) -> None:
    """Report the trial: its values and memory constraint, or FAIL when it has no values."""
    from optuna.trial import TrialState

    trial.set_user_attr("trial_key", result["trial_key"])
    trial.set_user_attr("status", result["status"])
    trial.set_user_attr("mlflow_run_id", run_id)
    values = objective_values(spec, result)
    if values is None:
        study.tell(trial, state=TrialState.FAIL)
        return
    trial.set_constraint("memory", memory_constraint(spec, result))
    study.tell(trial, values)


def trials_to_run(spec: Spec, recorded: int, more: int | None) -> int:
    """Grid: every unrecorded point. Optuna: up to ``search.n_trials`` recorded in all, or
    ``more`` beyond what is recorded (``--n-trials``), never past the grid's size."""
    size = len(spec.points())
    if spec.search.method == "grid":
        return size - recorded
    wanted = recorded + more if more is not None else spec.search.n_trials or 0
    return max(0, min(wanted, size) - recorded)


def suggest_point(trial: Any, spec: Spec) -> dict[str, Any]:
    return {axis: trial.suggest_categorical(axis, values) for axis, values in spec.axes().items()}


class SearchPlan:
    """The trials a sweep runs next: ``(optuna trial, grid point, config)`` one at a time.

    ``grid``: every point not yet recorded, in grid order. ``optuna``: ``to_run`` points that
    the sampler proposes, skipping points already measured in this sweep. A proposal of a
    measured point is answered with that point's recorded values at once (the sampler learns
    the same from it) and counts for nothing; after ``MAX_REPEATS`` such proposals in a row an
    unmeasured point is taken at random.
    """

    def __init__(self, study: Any, spec: Spec, recorded: set[str], to_run: int) -> None:
        self.study, self.spec = study, spec
        self.measured = set(recorded)
        self.to_run = to_run
        self.random = random.Random(spec.train.seed + len(recorded))
        self.by_key = {spec.trial_config(point).trial_key: point for point in spec.points()}

    def __iter__(self) -> Iterator[tuple[Any, dict[str, Any], TrialConfig]]:
        if self.spec.search.method == "grid":
            for point in self.spec.points():
                config = self.spec.trial_config(point)
                if config.trial_key not in self.measured:
                    yield ask(self.study, self.spec, point), point, config
            return
        for _ in range(self.to_run):
            proposal = self.propose()
            if proposal is None:
                return  # every grid point has been measured
            self.measured.add(proposal[2].trial_key)
            yield proposal

    def propose(self) -> tuple[Any, dict[str, Any], TrialConfig] | None:
        unmeasured = [key for key in self.by_key if key not in self.measured]
        if not unmeasured:
            return None
        for _ in range(MAX_REPEATS):
            trial = self.study.ask()
            point = suggest_point(trial, self.spec)
            config = self.spec.trial_config(point)
            if config.trial_key not in self.measured:
                return trial, point, config
            self.repeat(trial, config.trial_key)
        point = self.by_key[self.random.choice(unmeasured)]
        return ask(self.study, self.spec, point), point, self.spec.trial_config(point)

    def repeat(self, trial: Any, key: str) -> None:
        """Answer a proposal of a measured point with what that point gave."""
        from optuna.trial import TrialState

        earlier = [
            t
            for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.user_attrs.get("trial_key") == key
        ]
        trial.set_user_attr("repeat_of", key)
        if not earlier:
            self.study.tell(trial, state=TrialState.FAIL)
            return
        for name, value in earlier[-1].constraints.items():
            trial.set_constraint(name, value)
        self.study.tell(trial, earlier[-1].values)
