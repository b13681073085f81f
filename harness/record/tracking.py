"""MLflow recording: one parent run per sweep, one child run per trial.

Runs are written with ``MlflowClient`` and explicit run ids (never the fluent "active run"), so
nothing depends on global state. A child run is created only once its trial has finished, in one
batch, so a killed sweep never leaves half-recorded trials behind.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from harness.contract import DEFAULT_MLFLOW_URI
from harness.record.columns import KNOB_PREFIX, PARAMS
from harness.record.store_checks import require_tracking_store
from harness.record.stores import initialise_mlflow_store, prepare_store, quiet_mlflow, redact
from harness.trial.config import TrialConfig
from harness.trial.result import Status, TrialResult
from harness.units import format_bytes, format_quantity

ROLE_TAG = "harness_role"
SWEEP_ROLE, TRIAL_ROLE = "sweep", "trial"
PARENT_TAG = "mlflow.parentRunId"
# A sweep's identity in MLflow: its parent run carries the study's name (spec hash, hardware and
# search method in one), so a sweep is found again from its records whatever happened to the
# study. ``--fresh`` marks the parent run it starts: the sweeps of that identity before it are
# history, not the sweep to resume.
STUDY_TAG = "study_name"
FRESH_TAG = "harness_fresh"
# On a parent run a start has just created and that has not yet won its sweep's election
# (``harness.sweep.plan.elect_parent``): no reader takes it for the sweep before it has (a
# loser deletes it), so racing starts never see two sweeps of one identity.
CANDIDATE_TAG = "harness_candidate"
BATCH = 1000  # MLflow's log_batch limit on entities (metrics + params + tags) per call
PARAMS_PER_BATCH = 100  # ... and on params per call
HISTORY_POINTS = 250  # most points of a trial's per-step loss curve kept in MLflow
# MLflow's run status: a trial that measured what it could is FINISHED, one that broke FAILED.
ENDED_RUN_STATUS = {
    Status.OK: "FINISHED",
    Status.OOM: "FINISHED",
    Status.INFEASIBLE: "FINISHED",
    Status.DIVERGED: "FINISHED",
}

# ---- how MLflow's UI shows a sweep ----------------------------------------------------------
# MLflow 3's UI opens an experiment on its GenAI pages (overview, traces: "Traces 0") unless it
# knows the experiment trains models. MLflow 3.17 decides by the sidebar's workflow switch,
# "GenAI" or "Machine learning": the URL's `workflowType` parameter, else the choice the browser
# saved (localStorage `mlflow.workflowType`, "genai" until switched). A UI built without that
# switch reads the experiment tag `mlflow.experimentKind` instead (3.17's bundle still has the
# code, behind the switch's flag). So the experiment carries the tag and the sweep prints a URL
# with the parameter (`runs_url`).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"  # the UI's "Machine learning" kind
LOCAL_UI = "http://127.0.0.1:5000"  # where `make ui` serves
# A saved view of the runs table, as the UI's "Share" button saves one: an experiment tag
# `mlflow.sharedViewState.<key>` holding the table's filter and columns, opened by the URL's
# `viewStateShareKey=<key>`. Ours lists the trials with their key metrics as columns, least
# memory first: sorted by anything but the start time, the table lists child runs as rows of
# their own instead of folding them under their parent run (the sweep, filtered out). Columns
# the user picks afterwards are the browser's own (kept per experiment in localStorage).
VIEW_KEY = "harness-trials"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
NOTE_TAG = "mlflow.note.content"  # a run's description: the table's "Description" column
KEY_METRICS = ("peak_allocated_bytes", "throughput", "accuracy", "step_time_ms_p50")
RUNS_VIEW = json.dumps(
    {
        "searchFilter": f"tags.{ROLE_TAG} = '{TRIAL_ROLE}'",
        "orderByKey": "metrics.`peak_allocated_bytes`",
        "orderByAsc": True,
        "selectedColumns": [
            "attributes.`Description`",
            "tags.`status`",
            *(f"metrics.`{name}`" for name in KEY_METRICS),
        ],
    }
)
EXPERIMENT_TAGS = {EXPERIMENT_KIND_TAG: TRAINING_KIND, VIEW_TAG: RUNS_VIEW}


def runs_url(experiment_id: str, ui: str = LOCAL_UI) -> str:
    """The MLflow UI's page of an experiment's trials: its runs table (not the GenAI overview),
    filtered to the trials, their key metrics as columns."""
    query = f"workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"
    return f"{ui.rstrip('/')}/#/experiments/{experiment_id}/runs?{query}"


def ui_hint(tracking_uri: str, experiment: str) -> str:
    """How to see an experiment's trials in the MLflow UI: what starts it and the URL to open
    (the UI's front page when the experiment cannot be looked up)."""
    remote = urlparse(tracking_uri).scheme in ("http", "https")
    ui = redact(tracking_uri).rstrip("/") if remote else LOCAL_UI
    try:
        from mlflow.tracking import MlflowClient

        quiet_mlflow()
        found = MlflowClient(tracking_uri=tracking_uri).get_experiment_by_name(experiment)
        url = runs_url(found.experiment_id, ui) if found else ui
    except Exception:  # a hint: never fail a finished sweep over it
        url = ui
    if remote:
        return f"the MLflow UI at {url}"
    if tracking_uri == DEFAULT_MLFLOW_URI:
        return f"make ui, then open {url}"
    return f"mlflow ui --backend-store-uri {tracking_uri}, then open {url}"


def tag_experiment(client: Any, experiment_id: str, tags: dict[str, str]) -> None:
    """Make the MLflow UI show the experiment as model training with its trials' table
    (``EXPERIMENT_TAGS``); a kind the user chose in the UI stays theirs."""
    from mlflow.exceptions import MlflowException

    for key, value in EXPERIMENT_TAGS.items():
        if key in tags and (key == EXPERIMENT_KIND_TAG or tags[key] == value):
            continue
        # Another worker may be writing the same tag this moment: theirs is as good.
        with contextlib.suppress(MlflowException):
            client.set_experiment_tag(experiment_id, key, value)


def ui_links(tracking_uri: str, ui: str = LOCAL_UI) -> list[tuple[str, str]]:
    """``(experiment, runs_url)`` for each experiment of the store that holds a sweep (`make
    ui` prints them), tagging those recorded before the tags existed; none for a SQLite store
    not created yet."""
    from mlflow.tracking import MlflowClient

    local = urlparse(tracking_uri).scheme == "sqlite"
    if local and not Path(tracking_uri.removeprefix("sqlite:///")).exists():
        return []
    quiet_mlflow()
    client = MlflowClient(tracking_uri=tracking_uri)
    links = []
    for experiment in client.search_experiments():
        sweep = f"tags.{ROLE_TAG} = '{SWEEP_ROLE}'"
        if not client.search_runs([experiment.experiment_id], sweep, max_results=1):
            continue
        tag_experiment(client, experiment.experiment_id, experiment.tags)
        links.append((experiment.name, runs_url(experiment.experiment_id, ui)))
    return links


def trial_note(result: TrialResult) -> str:
    """A trial's key numbers with their units, as the run's description (MLflow's table shows
    metrics as bare numbers: 1234567.0 for a peak in bytes)."""
    metrics = result.metrics
    parts = [] if result.status == Status.OK else [result.status.value]  # its own column too
    if "peak_allocated_bytes" in metrics:
        parts.append(f"peak {format_bytes(metrics['peak_allocated_bytes'], short=True)}")
    if "throughput" in metrics:
        unit = result.info.get("throughput_unit", "samples/s")
        parts.append(format_quantity(metrics["throughput"], str(unit)))
    if "accuracy" in metrics:
        parts.append(f"acc {format_quantity(metrics['accuracy'])}")
    if "step_time_ms_p50" in metrics:
        parts.append(f"step {format_quantity(metrics['step_time_ms_p50'], 'ms')}")
    if result.failure_reason:
        parts.append(f"({result.failure_reason})")
    return " · ".join(parts)


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def trial_params(config: TrialConfig, result: TrialResult) -> dict[str, str]:
    """The trial's configuration as MLflow params (strings; the results layer casts them back)."""
    params: dict[str, Any] = {
        "model": config.model_family,
        "model_size": config.model_size,
        "batch_size": config.batch_size,
        "dtype": config.dtype,
        "strategy": config.strategy_text,
        "optimizer": result.info.get("optimizer", config.optimizer.name),
        "lr": result.info.get("lr", config.optimizer.lr),
        "weight_decay": config.optimizer.weight_decay,
        "momentum": result.info.get("momentum", config.optimizer.momentum),
        "foreach": config.optimizer.foreach,
        "dataset": config.dataset,
        "device": result.info.get("device", config.device),
        "world_size": config.world_size,
        "seed": config.seed,
        "budget": config.budget.text,
        "warmup_steps": config.warmup_steps,
        "memory_steps": config.memory_steps,
        "timed_steps": config.timed_steps,
        "device_memory_bytes": config.device_memory_bytes or "",
    }
    assert params.keys() == PARAMS.keys(), "record/columns.py lists the params a trial records"
    params.update({f"{KNOB_PREFIX}{name}": value for name, value in config.model_knobs.items()})
    return {key: str(value) for key, value in params.items()}


def all_runs(
    client: Any, experiment_ids: list[str], filter_string: str, order_by: list[str] | None = None
) -> list[Any]:
    """Every run matching the filter (MLflow returns at most 1,000 a page)."""
    runs, token = [], None
    while True:
        page = client.search_runs(
            experiment_ids,
            filter_string=filter_string,
            max_results=1000,
            order_by=order_by,
            page_token=token,
        )
        runs.extend(page)
        token = page.token
        if not token:
            return runs


SHORT_ID = 8  # characters of a sweep's parent run id that tables print and run names carry


def trial_run_name(label: str, parent_run_id: str) -> str:
    """A trial run's MLflow name: its grid point and its sweep's short id, so the runs of two
    sweeps of one experiment read apart in the MLflow UI (``s bs=8 fp32 none @3f9a1c2e``)."""
    return f"{label} @{parent_run_id[:SHORT_ID]}"


def trials_of(parent_run_id: str, *conditions: str) -> str:
    """The filter that finds the trial runs of one sweep (and ``conditions``, ``and``-ed)."""
    parts = [f"tags.{ROLE_TAG} = '{TRIAL_ROLE}'", f"tags.`{PARENT_TAG}` = '{parent_run_id}'"]
    return " and ".join([*parts, *conditions])


def sweep_parents(client: Any, experiment_ids: list[str], study_name: str) -> list[Any]:
    """The parent runs of one sweep identity since its last ``--fresh`` start, newest first."""
    runs = all_runs(
        client,
        experiment_ids,
        f"tags.{ROLE_TAG} = '{SWEEP_ROLE}' and tags.{STUDY_TAG} = '{study_name}'",
        order_by=["attributes.start_time DESC"],
    )
    runs = [run for run in runs if not run.data.tags.get(CANDIDATE_TAG)]
    for index, run in enumerate(runs):
        if run.data.tags.get(FRESH_TAG):
            return runs[: index + 1]
    return runs


def finished_trial_count(client: Any, experiment_ids: list[str], parent_run_id: str) -> int:
    """How many trials are fully recorded under a parent run (a RUNNING one was cut off)."""
    finished = trials_of(parent_run_id, "attributes.status != 'RUNNING'")
    return len(all_runs(client, experiment_ids, finished))


def settled_sweep(
    client: Any, experiment_ids: list[str], study_name: str, prefer: str | None = None
) -> Any | None:
    """The parent run that IS the sweep of this identity: of those since its last ``--fresh``
    start, the one with the most recorded trials (a tie: ``prefer``, the one the study names,
    then the newest). Why not simply the newest: a start that lost its study (deleted, emptied,
    another storage) used to begin a second, partial parent run beside the finished one, and a
    killed first start leaves a parent run with no trials."""
    parents = sweep_parents(client, experiment_ids, study_name)
    if len(parents) <= 1:
        return parents[0] if parents else None
    counts = {
        run.info.run_id: finished_trial_count(client, experiment_ids, run.info.run_id)
        for run in parents
    }

    def rank(item: tuple[int, Any]) -> tuple[int, bool, int]:
        newest_first, run = item
        return counts[run.info.run_id], run.info.run_id == prefer, -newest_first

    return max(enumerate(parents), key=rank)[1]


def recorded_statuses(runs: list[Any]) -> dict[str, str]:
    """``trial_key -> status`` of the fully recorded trial runs among ``runs``: a run is
    terminated as the last step of recording it, so one still RUNNING was cut off mid-write
    by a killed sweep and does not count."""
    return {
        run.data.tags.get("trial_key", ""): run.data.tags.get("status", "")
        for run in runs
        if run.info.status != "RUNNING"
    }


def recorded_for(tracking_uri: str, experiment: str, study_name: str) -> dict[str, str]:
    """What MLflow holds of one sweep identity (``settled_sweep``), read without creating or
    changing anything (``harness sweep --dry-run``): empty where the store, the experiment
    or the sweep does not exist yet."""
    local = tracking_uri.startswith("sqlite:///")
    if local and not Path(tracking_uri.removeprefix("sqlite:///")).exists():
        return {}
    require_tracking_store(tracking_uri, "tracking.mlflow_uri")  # unusable: one line, no wait
    from mlflow.tracking import MlflowClient

    quiet_mlflow()
    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return {}
    parent = settled_sweep(client, [found.experiment_id], study_name)
    if parent is None:
        return {}
    trials = all_runs(client, [found.experiment_id], trials_of(parent.info.run_id))
    return recorded_statuses(trials)


# train.budget.eval_every: the held-out metrics evaluated during training, as metric histories.
EVAL_CURVES = {
    "eval_loss": "eval_loss_step",
    "accuracy": "accuracy_step",
    "perplexity": "perplexity_step",
}


def eval_curve(rows: list[dict[str, float]]) -> list[tuple[str, float, int]]:
    """``(history name, value, step)`` for each evaluation during training, at the optimizer
    steps taken before it (0: before training); a non-finite value is left out, as MLflow
    stores none."""
    return [
        (name, float(row[metric]), int(row["step"]))
        for row in rows
        for metric, name in EVAL_CURVES.items()
        if metric in row and math.isfinite(row[metric])
    ]


def loss_curve(losses: list[float], points: int = HISTORY_POINTS) -> list[tuple[int, float]]:
    """``(step, loss)`` for MLflow's metric history: every step up to ``points`` steps, else the
    mean of each of ``points`` equal runs of consecutive steps, at the run's last step.

    Why: MLflow stores a history row by row, ~0.1 ms each; a 2,700-step trial took 0.3 s to
    record, more than the rest of its bookkeeping. The curve looks the same, and every step's
    loss stays in the trial's ``result.json`` artifact.
    """
    if len(losses) <= points:
        return list(enumerate(losses))
    curve = []
    for index in range(points):
        start, end = index * len(losses) // points, (index + 1) * len(losses) // points
        chunk = losses[start:end]
        curve.append((end - 1, sum(chunk) / len(chunk)))
    return curve


class Tracker:
    def __init__(self, uri: str, experiment: str, artifact_root: Path) -> None:
        from mlflow.tracking import MlflowClient

        quiet_mlflow()
        prepare_store(uri, initialise_mlflow_store)

        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        self.commit = git_commit()
        found = self.client.get_experiment_by_name(experiment) or self._create(
            experiment, artifact_root
        )
        if found.lifecycle_stage == "deleted":
            self.client.restore_experiment(found.experiment_id)
        self.experiment_id = found.experiment_id
        tag_experiment(self.client, self.experiment_id, found.tags)

    def _create(self, experiment: str, artifact_root: Path) -> Any:
        from mlflow.exceptions import MlflowException

        # A tracking server stores artifacts where it is told to (every host can reach it);
        # a local store keeps them under results/, where `mlflow ui` finds them.
        remote = urlparse(self.uri).scheme in ("http", "https")
        if not remote:
            artifact_root.mkdir(parents=True, exist_ok=True)
        location = None if remote else artifact_root.resolve().as_uri()
        # Another worker may have created it a moment ago: then use theirs.
        with contextlib.suppress(MlflowException):
            self.client.create_experiment(experiment, artifact_location=location)
        return self.client.get_experiment_by_name(experiment)

    # ---- the sweep's parent run ---------------------------------------------------------------

    def open_sweep(
        self, run_id: str | None, name: str, tags: dict[str, str], params: dict[str, str]
    ) -> str:
        """Resume the sweep's parent run if it still exists, else start a new one."""
        if run_id:
            from mlflow.exceptions import MlflowException

            try:
                run = self.client.get_run(run_id)
            except MlflowException:
                run = None
            if run is not None and run.info.lifecycle_stage == "active":
                self.client.update_run(run_id, status="RUNNING")
                return run_id
        run = self.client.create_run(
            self.experiment_id, run_name=name, tags={ROLE_TAG: SWEEP_ROLE, **tags}
        )
        self._log(run.info.run_id, params=params)
        return run.info.run_id

    def is_live(self, run_id: str) -> bool:
        """Whether the run exists in this store and is not deleted."""
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except MlflowException:
            return False

    def confirm_sweep(self, run_id: str) -> None:
        """The parent run won its election: readers take it for the sweep from now on."""
        self.client.delete_tag(run_id, CANDIDATE_TAG)

    def settled_sweep(self, study_name: str, prefer: str | None = None) -> str | None:
        """The parent run id of this sweep identity as MLflow records it (``settled_sweep``)."""
        found = settled_sweep(self.client, [self.experiment_id], study_name, prefer)
        return found.info.run_id if found is not None else None

    def close_sweep(self, run_id: str, metrics: dict[str, float], status: str = "FINISHED") -> None:
        self._log(run_id, metrics=metrics)
        self.client.set_terminated(run_id, status=status)

    def trial_runs(self, parent_run_id: str) -> list[Any]:
        return list(self.search(trials_of(parent_run_id)))

    def recorded_trials(self, parent_run_id: str) -> dict[str, str]:
        """``trial_key -> status`` of the trials fully recorded under this sweep (never run again).

        A trial's run is terminated as the last step of recording it, so a run still RUNNING was
        cut off mid-write by a killed sweep and does not count.
        """
        return recorded_statuses(self.trial_runs(parent_run_id))

    def supersede_trials(self, parent_run_id: str, statuses: set[str]) -> list[str]:
        """``--retry-failed``: the recorded trials with these statuses step aside for a new
        run of the same point: tagged ``superseded`` and deleted (MLflow keeps deleted runs
        restorable; ``harness results`` reads active runs only). Their trial keys."""
        keys = []
        for run in self.trial_runs(parent_run_id):
            if run.info.status == "RUNNING" or run.data.tags.get("status") not in statuses:
                continue
            self.client.set_tag(run.info.run_id, "superseded", "retry-failed")
            self.client.delete_run(run.info.run_id)
            keys.append(run.data.tags.get("trial_key", ""))
        return keys

    def discard_unfinished_trials(self, parent_run_id: str) -> int:
        """Delete half-written trial runs a killed sweep left behind; their trials run again."""
        return self.discard_unfinished(self.trial_runs(parent_run_id))

    def discard_point(self, parent_run_id: str, trial_key: str) -> int:
        """Delete every run of one point, finished or not; how many. For a worker about to
        record a point whose earlier holder died while recording it, or just after (its run
        finished, the study not yet told): the new run replaces it, so the point stays once."""
        runs = self.search(trials_of(parent_run_id, f"tags.trial_key = '{trial_key}'"))
        for run in runs:
            self.client.delete_run(run.info.run_id)
        return len(runs)

    def discard_unfinished(self, runs: list[Any]) -> int:
        """Delete the half-written runs (still RUNNING) among ``runs``; how many."""
        unfinished = [run for run in runs if run.info.status == "RUNNING"]
        for run in unfinished:
            self.client.delete_run(run.info.run_id)
        return len(unfinished)

    def search(self, filter_string: str) -> list[Any]:
        return all_runs(self.client, [self.experiment_id], filter_string)

    # ---- one trial ----------------------------------------------------------------------------

    def log_trial(
        self,
        parent_run_id: str,
        config: TrialConfig,
        result: TrialResult,
        workdir: Path,
        started_ms: int,
        run_name: str,
    ) -> str:
        # Everything the trial reported about itself (device, threads, strategy notes) as tags;
        # a trial that reported nothing (crash, timeout) still names the hardware it was for.
        tags = {key: str(value) for key, value in (config.hardware or {}).items()}
        tags |= {key: str(value) for key, value in result.info.items()}
        tags |= {
            ROLE_TAG: TRIAL_ROLE,
            PARENT_TAG: parent_run_id,
            "trial_key": config.trial_key,
            "status": result.status.value,
            "failure_reason": result.failure_reason,
            "attempts": str(result.attempts),  # > 1: crash/timeout retried
            NOTE_TAG: trial_note(result),
        }
        if config.batch_size_search:  # grid.batch_size: max, and how the batch was found
            tags["batch_size_search"] = config.batch_size_search
        if self.commit:
            tags["git_commit"] = self.commit
        run = self.client.create_run(
            self.experiment_id, run_name=run_name, start_time=started_ms, tags=tags
        )
        run_id = run.info.run_id
        metrics = dict(result.metrics)
        if result.wall_time_s is not None:
            metrics["trial_wall_time_s"] = result.wall_time_s
        history = [
            ("train_loss_step", value, step) for step, value in loss_curve(result.loss_history)
        ]
        history += eval_curve(result.eval_history)
        self._log(run_id, metrics=metrics, params=trial_params(config, result), history=history)
        self.client.log_artifacts(run_id, str(workdir), artifact_path="trial")
        self.client.set_terminated(run_id, status=ENDED_RUN_STATUS.get(result.status, "FAILED"))
        return run_id

    def _log(
        self,
        run_id: str,
        metrics: dict[str, float] | None = None,
        params: dict[str, str] | None = None,
        history: list[tuple[str, float, int]] | None = None,
    ) -> None:
        """As few ``log_batch`` calls as MLflow's limits allow (one for a typical trial: each
        call is a database transaction, the bulk of recording cost)."""
        from mlflow.entities import Metric, Param

        now = int(time.time() * 1000)
        entries = [Metric(k, float(v), now, 0) for k, v in (metrics or {}).items()]
        entries += [Metric(k, float(v), now, step) for k, v, step in history or []]
        param_list = [Param(k, v) for k, v in (params or {}).items()]
        while entries or param_list:
            some_params, param_list = param_list[:PARAMS_PER_BATCH], param_list[PARAMS_PER_BATCH:]
            room = BATCH - len(some_params)
            some_metrics, entries = entries[:room], entries[room:]
            self.client.log_batch(run_id, metrics=some_metrics, params=some_params)


def publish(tracking_uri: str, run_id: str, paths: list[Path], folder: str) -> None:
    """Copy files onto a run (a sweep's parent run), so the MLflow UI shows them beside it."""
    quiet_mlflow()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    for path in paths:
        client.log_artifact(run_id, str(path), artifact_path=folder)
