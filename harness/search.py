"""The Optuna side of a sweep: the study that holds the grid, its storage, and what it is told.

A grid sweep is an Optuna study with a ``GridSampler`` over the spec's axes. Each grid point is
enqueued and asked for in order, so the study records every trial (resume, workers and Optuna
samplers build on the same study in later work). Objective values come from the spec.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

from harness.spec import Spec, SpecError
from harness.tracking import prepare_store


def study_name(spec: Spec) -> str:
    return f"{spec.experiment}-{spec.grid_hash()}"


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
    study = optuna.create_study(
        study_name=name,
        storage=spec.tracking.storage,
        sampler=planned_grid_sampler(spec),
        directions=[objective.direction for objective in spec.search.objectives],
        load_if_exists=True,
    )
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


def tell(study: Any, trial: Any, spec: Spec, result: dict[str, Any], run_id: str) -> None:
    """Report the trial's objective values; a trial without them (crash, timeout) is FAIL."""
    from optuna.trial import TrialState

    trial.set_user_attr("trial_key", result["trial_key"])
    trial.set_user_attr("status", result["status"])
    trial.set_user_attr("mlflow_run_id", run_id)
    metrics = result.get("metrics", {})
    values = [metrics.get(objective.metric) for objective in spec.search.objectives]
    if all(value is not None and math.isfinite(value) for value in values):
        study.tell(trial, values)
    else:
        study.tell(trial, state=TrialState.FAIL)
