"""A sweep's start: its stores checked, its hardware and ``max`` batches resolved, its Optuna
study and MLflow parent run opened (one of them elected where starts race), what a retry
frees. ``harness sweep``, each ``harness worker`` and each launcher's worker start here.
"""

from __future__ import annotations

import itertools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.record.stores import redact
from harness.record.tracking import CANDIDATE_TAG, FRESH_TAG, STUDY_TAG, Tracker
from harness.spec import (
    Spec,
    SpecError,
)
from harness.spec.grid import SweepPlan, max_batch_key
from harness.spec.schema import MAX_BATCH
from harness.sweep import claim, plan, preflight
from harness.sweep.claim import StudyAttr
from harness.sweep.launch import start_warm_starter
from harness.trial.hardware import host_hardware
from harness.trial.result import OVER_BUDGET, RETRYABLE, Status
from harness.units import format_bytes

if TYPE_CHECKING:
    from optuna import Study


def sweep_params(sweep: SweepPlan) -> dict[str, str]:
    spec = sweep.spec
    axes = spec.axes()
    return {
        "model": spec.model.family,
        "dataset": spec.data.dataset,
        "n_trials": str(len(sweep.points)),
        **{f"axis_{name}": ",".join(map(str, values)) for name, values in axes.items()},
        "budget": spec.train.budget.budget().text,
        "device": spec.device,
        "device_memory_bytes": str(spec.memory_budget or ""),
        "search_method": spec.search.method,
        # What `harness pareto` compares by default, e.g. "peak_allocated_bytes:min,throughput:max".
        "objectives": ",".join(str(o.objective()) for o in spec.search.objectives),
    }


# ``--retry-failed``: which statuses each choice runs again.
RETRY_STATUSES: dict[str, tuple[Status, ...]] = {
    "failed": RETRYABLE,
    "all": (*RETRYABLE, *OVER_BUDGET, Status.DIVERGED),
}


@dataclass
class SweepState:
    """What every worker of one sweep shares: the study, the MLflow parent run, the spec as
    the user wrote it and the plan the sweep resolved from it on this host."""

    plan: SweepPlan
    study: Study
    tracker: Tracker
    parent: str
    interrupted: int
    retried: int = 0
    # Set when this spec was swept before on other hardware: what that was.
    other_hardware: str | None = None
    # Recorded trials the study did not hold, copied into it from MLflow (lost, emptied or
    # switched storage), and why the parent run is not the one the study named.
    restored: int = 0
    study_named: str | None = None  # "" when it named none

    @property
    def spec(self) -> Spec:
        return self.plan.spec


def prepare(
    spec: Spec,
    fresh: bool = False,
    worker: bool = False,
    runs_trials: bool = True,
    retry: str | None = None,
    launch: str | None = None,
) -> SweepState:
    """Open (or start) the sweep's study and MLflow parent run; fail dead workers' trials.

    The spec is first tied to this host's hardware (``harness.trial.hardware``): the resolved
    device and its name are part of every trial's identity, so the same spec on other hardware
    is another sweep. A ``worker`` joins a sweep that others may be running: it neither starts
    afresh nor deletes half-written trial runs (those may be another worker's, being written
    right now). Where this process ``runs_trials``, the warm trial starter imports torch
    meanwhile. ``retry`` (``failed`` or ``all``) frees the points of recorded trials with those
    statuses (``RETRY_STATUSES``) so they run again under the same parent run. ``launch``
    (a ``--launcher`` submission's id) is noted on the study, so ``harness sweep --wait`` finds
    the study its workers chose (their hardware names it).
    """
    preflight.check_stores(spec)  # before anything is created or any trial runs
    if runs_trials:
        preflight.check_device(spec)
    sweep = SweepPlan(spec).on_hardware(host_hardware(spec.device))
    if runs_trials:
        start_warm_starter()
    sweep = resolve_max_batch(sweep)  # before hashing: the found batches are in the trial keys
    results_dir = Path(spec.tracking.results_dir)
    study = plan.open_study(sweep, fresh=fresh)
    other_hardware = plan.swept_elsewhere(study, sweep)
    interrupted = claim.fail_stale_trials(study)
    if launch:
        study.set_user_attr(f"{StudyAttr.LAUNCH}{launch}", time.time())
    tracker = Tracker(
        spec.tracking.mlflow_uri, spec.experiment, results_dir / "mlartifacts" / spec.experiment
    )
    named = None if fresh else study.user_attrs.get(StudyAttr.PARENT)
    # The sweep is what MLflow recorded for this identity, whatever the study (lost, emptied,
    # another storage) remembers: recorded trials are never run again.
    known = None if fresh else tracker.settled_sweep(study.study_name, prefer=named)
    # Workers may start a sweep together (``harness worker`` on many hosts, a launcher's
    # jobs); ``harness sweep`` prepares its sweep alone, its own workers start after.
    race = worker and known is None
    parent = tracker.open_sweep(
        known,
        name=f"sweep {spec.experiment}",
        tags={
            "spec_name": spec.name,
            "grid_hash": sweep.grid_hash,
            STUDY_TAG: study.study_name,
            **hardware_tags(sweep),
            **({FRESH_TAG: "true"} if fresh else {}),
            **({CANDIDATE_TAG: "true"} if race else {}),
        },
        params=sweep_params(sweep),
    )
    if race:  # a new parent run: the workers starting this sweep elect one of theirs
        elected = plan.elect_parent(spec, study, parent, tracker.is_live)
        if elected == parent:
            tracker.confirm_sweep(parent)
        else:
            tracker.client.delete_run(parent)
            parent = elected
    if parent != named:
        study.set_user_attr(StudyAttr.PARENT, parent)
        if spec._source:
            log_spec(tracker, parent, Path(spec._source))
    retried, restored = 0, 0
    if not worker:
        runs = tracker.trial_runs(parent)  # read once for both
        tracker.discard_unfinished(runs)  # each also left a stale study trial
        # (workers leave it to the process that prepared the sweep: two copying at once
        # would teach the sampler every trial twice)
        restored = plan.restore_trials(study, sweep, runs)
        if retry:
            statuses = {status.value for status in RETRY_STATUSES[retry]}
            keys = tracker.supersede_trials(parent, statuses)
            retried = plan.free_points(study, sweep, keys)
    adopted = known and known != named  # the study named another run, or none
    study_named = (named or "") if adopted else None
    return SweepState(
        sweep, study, tracker, parent, interrupted, retried, other_hardware, restored, study_named
    )


def resolve_max_batch(sweep: SweepPlan, target: str | None = None) -> SweepPlan:
    """``grid.batch_size: max``: for each model size x dtype x strategy, the largest batch whose
    predicted peak fits ``device_memory`` (``harness.sweep.fit``: the estimator at a few batch
    sizes, in a child process), kept on the plan (``SweepPlan.max_batch``) for its trial configs.

    ``target`` is the device type predicted for (default: the hardware the plan is tied to,
    ``SweepPlan.on_hardware``). Where not even the smallest allowed batch fits (or the estimator cannot
    predict) that smallest batch stands in: the trial's own prediction then records it
    ``infeasible`` (or runs it). A spec without ``max``, or already resolved, is returned as is.
    """
    spec = sweep.spec
    if MAX_BATCH not in spec.grid.batch_size or sweep.max_batch:
        return sweep
    from harness.sweep.estimate import EstimateError
    from harness.sweep.fit import default_jobs, fit_configs, upper_bound

    target = (target or (sweep.hardware or {}).get("device") or spec.device).split(":")[0]
    budget = int(spec.memory_budget or 0)
    keys = list(itertools.product(spec.model.sizes, spec.grid.dtype, spec.grid.strategy))
    points_at_step = [  # at the smallest allowed batch; the search sets its own
        {"model_size": m, "batch_size": g.batch_step, "dtype": d, "strategy": g.text}
        for m, d, g in keys
    ]
    configs = [sweep.trial_config(point) for point in points_at_step]
    print(
        f"grid.batch_size max: finding the largest batch within {format_bytes(budget)} for "
        f"{len(configs)} configuration(s), predicted on {target} ...",
        file=sys.stderr,
        flush=True,
    )
    try:
        answers = fit_configs(configs, target, [budget], "batch_size", None, default_jobs())
    except EstimateError as error:
        raise SpecError(f"{spec._source or '<spec>'}: grid.batch_size: max: {error}") from None
    found = {}
    for point, config, answer in zip(points_at_step, configs, answers, strict=True):
        bound = upper_bound(config, "batch_size", None)
        found[max_batch_key(point)] = max_batch_entry(
            answer["rows"][0], config.batch_size, budget, bound
        )
    return sweep.with_max_batch(found)


def max_batch_entry(row: dict[str, Any], step: int, budget: int, bound: int) -> dict[str, Any]:
    """One configuration's resolved ``max``: the batch it trains at and how it was found (the
    trial's ``batch_size_search`` tag), e.g. ``max within 16.00 GiB: 142 (model, 4 predictions)``."""
    within = f"{MAX_BATCH} within {format_bytes(budget)}"
    value, count = row.get("value"), row.get("predictions")
    if value is None:  # refused or unpredictable at any batch
        from harness.trial.prediction import Prediction

        why = Prediction.from_dict(row).reason or "no prediction"
        search = f"{within}: not predicted ({why}); the smallest allowed batch {step}"
        return {"batch_size": step, "search": search, "method": "not predicted"}
    if not value:
        search = f"{within}: none fits, the smallest allowed batch {step} ({count} predictions)"
        return {"batch_size": step, "search": search, "method": "none"}
    capped = ", the largest tried" if value + step > bound else ""
    search = f"{within}: {value} ({row.get('method')}, {count} predictions{capped})"
    return {
        "batch_size": int(value),
        "search": search,
        "method": row.get("method"),
        "predicted_peak_bytes": row.get("predicted_peak_bytes"),
    }


def log_spec(tracker: Tracker, parent: str, source: Path) -> None:
    """The spec file on the parent run, every password in its URLs replaced by ``***``."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        copy = Path(folder) / source.name
        copy.write_text(redact(source.read_text()))
        tracker.client.log_artifact(parent, str(copy), artifact_path="spec")


def hardware_tags(sweep: SweepPlan) -> dict[str, str]:
    """The parent run's ``device`` and ``device_name`` tags: what its trials ran on."""
    return {key: str(value) for key, value in (sweep.hardware or {}).items()}


def with_tracking(spec: Spec, **changes: str | None) -> Spec:
    """The spec with ``tracking`` keys replaced (``storage``, ``mlflow_uri``), source kept."""
    updates = {key: value for key, value in changes.items() if value is not None}
    if not updates:
        return spec
    copy = spec.model_copy(update={"tracking": spec.tracking.model_copy(update=updates)})
    copy._source = spec._source
    return copy
