"""MLflow -> one tidy pandas row per trial, with clean column names and proper dtypes.

``harness.results.load()`` is the notebook API; ``harness results`` prints or exports the same
table. MLflow stays the source of truth: nothing here caches or copies results.

Two read paths give the same frame. MLflow's ``search_runs`` builds a Python object per run,
param, tag and metric: ~19 s for 10,000 trials on a 2-core machine. For a database-backed store
(``sqlite:///``, ``postgresql://``, ``mysql://``) the same rows are read straight from MLflow's
own ``runs``/``params``/``tags``/``latest_metrics`` tables in four queries (``make bench``
measures both); any other store, or a schema this code does not recognise, uses ``search_runs``.
"""

from __future__ import annotations

import difflib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from harness.contract import DEFAULT_MLFLOW_URI
from harness.metrics import METRICS
from harness.record.columns import ID_COLUMNS, KNOB_PREFIX, TAGS, typed
from harness.record.stores import quiet_mlflow
from harness.record.tracking import (
    CANDIDATE_TAG,
    EVAL_CURVES,
    PARENT_TAG,
    ROLE_TAG,
    SHORT_ID,
    STUDY_TAG,
    SWEEP_ROLE,
    TRIAL_ROLE,
    all_runs,
    settled_sweep,
    trials_of,
)
from harness.trial.config import TIMELINE_FILE

INT_PARAMS = typed(int)
FLOAT_PARAMS = typed(float)
BOOL_PARAMS = typed(bool)
TAG_COLUMNS = tuple(TAGS)


HISTORY_METRICS = {
    "train_loss_step",
    *EVAL_CURVES.values(),
}  # per-step histories: read them with MlflowClient


class ResultsError(Exception):
    """Nothing to load (no store, no experiment, no sweep); the message says what to do."""


def _client(tracking_uri: str) -> Any:
    """A client of a store that is already MLflow's: checked first (``StoreError``: one line),
    since MLflow would create a missing store, migrate a foreign one or wait minutes on a
    server that is down."""
    from harness.record.store_checks import require_tracking_store

    if tracking_uri.startswith("sqlite:///"):
        path = Path(tracking_uri.removeprefix("sqlite:///"))
        if not path.exists():
            raise ResultsError(f"no MLflow store at {path}; run a sweep first (make sweep)")
    require_tracking_store(tracking_uri)  # before MLflow is imported: a bad store answers fast
    quiet_mlflow()
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def find_sweep(client: Any, experiment: str | None) -> tuple[str, Any]:
    """The experiment id and the latest sweep (parent run) in it, or in any experiment."""
    if experiment is not None:
        experiment_ids = [experiment_id_of(client, experiment)]
    else:
        experiment_ids = [e.experiment_id for e in client.search_experiments()]
    sweeps = client.search_runs(
        experiment_ids,
        filter_string=f"tags.{ROLE_TAG} = '{SWEEP_ROLE}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if not sweeps:
        where = f"experiment {experiment!r}" if experiment else "this store"
        raise ResultsError(f"no sweep recorded in {where}; run one first (make sweep)")
    latest = sweeps[0]
    # The latest sweep's identity (spec, hardware, search), and of its parent runs the one
    # with the most recorded trials: a later partial duplicate (a start that lost its study,
    # before harness found sweeps by their records) must not hide the finished one.
    study = latest.data.tags.get(STUDY_TAG)
    settled = settled_sweep(client, [latest.info.experiment_id], study) if study else None
    chosen = settled or latest
    return chosen.info.experiment_id, chosen


def experiment_id_of(client: Any, experiment: str) -> str:
    """The id of the experiment named ``experiment``, or one line naming the close names and
    every recorded one (a typo is the usual cause)."""
    found = client.get_experiment_by_name(experiment)
    if found is not None:
        return found.experiment_id
    names = sorted(e.name for e in client.search_experiments() if e.name != "Default")
    close = difflib.get_close_matches(experiment, names, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ResultsError(
        f"no experiment named {experiment!r}{hint} (recorded: {', '.join(names) or 'none'})"
    )


MIN_SWEEP_PREFIX = 6  # the fewest characters of one that name a sweep


def sweep_runs(client: Any, experiment_ids: list[str]) -> list[Any]:
    """The sweeps (parent runs) recorded in these experiments, oldest first: not an elected
    worker's losing candidate (deleted, or still tagged while the election runs)."""
    runs = all_runs(
        client,
        experiment_ids,
        f"tags.{ROLE_TAG} = '{SWEEP_ROLE}'",
        order_by=["attributes.start_time ASC"],
    )
    return [run for run in runs if not run.data.tags.get(CANDIDATE_TAG)]


def sweep_label(run: Any) -> str:
    """How tables name a sweep: its short id and when it started (UTC), ``3f9a1c2e 2026-12-05
    15:22``; the short id is what ``--sweep`` and ``harness compare`` take."""
    started = pd.to_datetime(run.info.start_time, unit="ms", utc=True)
    return f"{run.info.run_id[:SHORT_ID]} {started:%Y-%m-%d %H:%M}"


def _sweep_by_id(client: Any, run_id: str, experiment: str | None = None) -> tuple[str, str]:
    """The experiment id and full parent run id of the sweep ``run_id`` names (the whole id, or
    its first ``MIN_SWEEP_PREFIX``+ characters as ``harness sweeps`` prints it), or a clear
    error."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException:
        run = None
    if run is None:
        experiment_ids = (
            [experiment_id_of(client, experiment)]
            if experiment is not None
            else [e.experiment_id for e in client.search_experiments()]
        )
        matches = [
            r for r in sweep_runs(client, experiment_ids) if r.info.run_id.startswith(run_id)
        ]
        if len(run_id) < MIN_SWEEP_PREFIX or len(matches) != 1:
            several = f" ({len(matches)} sweeps start with it)" if len(matches) > 1 else ""
            raise ResultsError(
                f"no sweep with run id {run_id!r}{several}: give {MIN_SWEEP_PREFIX}+ characters "
                "of one that harness sweeps lists"
            )
        run = matches[0]
    if run.data.tags.get(ROLE_TAG) != SWEEP_ROLE:
        raise ResultsError(f"run {run_id!r} is not a sweep (parent) run")
    return run.info.experiment_id, run.info.run_id


def load(
    experiment: str | None = None,
    tracking_uri: str = DEFAULT_MLFLOW_URI,
    sweep: str = "latest",
    via: str = "auto",
) -> pd.DataFrame:
    """One row per trial.

    ``experiment``: an MLflow experiment (the spec's ``name``); default: the one that ran last.
    ``sweep``: ``"latest"`` (the trials of the experiment's most recent sweep), ``"all"`` (every
    sweep of the experiment) or a sweep's parent run id (or its first 6+ characters). The
    ``sweep`` column names each row's sweep as tables and ``harness sweeps`` do (``sweep_label``). ``via``: ``"auto"`` (MLflow's tables
    directly where the store is a database, else ``search_runs``) or ``"mlflow"`` (always
    ``search_runs``; the same frame, slower).
    """
    client = _client(tracking_uri)
    if sweep in ("latest", "all"):
        experiment_id, latest = find_sweep(client, experiment)
        parent = latest.info.run_id
    else:
        experiment_id, parent = _sweep_by_id(client, sweep, experiment)
    wanted_parent = None if sweep == "all" else parent
    raw = None if via == "mlflow" else raw_from_database(tracking_uri, experiment_id, wanted_parent)
    if raw is None:
        raw = raw_from_search(client, experiment_id, wanted_parent)
    labels = {run.info.run_id: sweep_label(run) for run in sweep_runs(client, [experiment_id])}
    parents = raw["sweep_run_id"] if "sweep_run_id" in raw else pd.Series(dtype=object)
    raw["sweep"] = parents.map(labels)
    return tidy(raw)


SWEEP_COLUMNS = [
    "experiment", "sweep", "selector", "status", "trials", "ok", "device_name", "started",
    "sweep_run_id",
]  # fmt: skip


def list_sweeps(
    tracking_uri: str = DEFAULT_MLFLOW_URI, experiment: str | None = None
) -> pd.DataFrame:
    """One row per recorded sweep (of ``experiment``, else of every experiment), oldest first:
    its label (``sweep``: short id and start time), the ``selector`` that ``harness compare``
    and ``--sweep`` take, its parent run's status, how many trials it recorded and how many
    of them ended ok, the device they ran on."""
    client = _client(tracking_uri)
    if experiment is not None:
        experiments = {experiment_id_of(client, experiment): experiment}
    else:
        experiments = {e.experiment_id: e.name for e in client.search_experiments()}
    rows = []
    for experiment_id, name in experiments.items():
        parents = sweep_runs(client, [experiment_id])
        if not parents:
            continue
        trials = load(name, tracking_uri, sweep="all")
        by_parent = dict(tuple(trials.groupby("sweep_run_id"))) if len(trials) else {}
        for run in parents:
            own = by_parent.get(run.info.run_id, trials.iloc[0:0])
            devices = own["device_name"].dropna().astype(str)
            rows.append(
                {
                    "experiment": name,
                    "sweep": sweep_label(run),
                    "selector": f"{name}@{run.info.run_id[:SHORT_ID]}",
                    "status": run.info.status,
                    "trials": len(own),
                    "ok": int((own["status"] == "ok").sum()),
                    "device_name": devices.iloc[0] if len(devices) else "",
                    "started": pd.to_datetime(run.info.start_time, unit="ms", utc=True),
                    "sweep_run_id": run.info.run_id,
                }
            )
    if not rows:
        where = f"experiment {experiment!r}" if experiment else "this store"
        raise ResultsError(f"no sweep recorded in {where}; run one first (make sweep)")
    return pd.DataFrame(rows, columns=SWEEP_COLUMNS).sort_values("started", kind="stable")


def raw_from_search(client: Any, experiment_id: str, parent: str | None) -> pd.DataFrame:
    """Trial runs through MLflow's ``search_runs``: one untyped row each (strings as logged)."""
    filter_string = f"tags.{ROLE_TAG} = '{TRIAL_ROLE}'" if parent is None else trials_of(parent)
    runs = all_runs(client, [experiment_id], filter_string, ["attributes.start_time ASC"])
    rows = []
    for run in runs:
        row: dict[str, Any] = dict(run.data.params)
        row.update({key: run.data.tags.get(key) for key in TAG_COLUMNS})
        row.update({k: v for k, v in run.data.metrics.items() if k not in HISTORY_METRICS})
        row["run_id"] = run.info.run_id
        row["sweep_run_id"] = run.data.tags.get(PARENT_TAG)
        row["start_time"] = pd.to_datetime(run.info.start_time, unit="ms", utc=True)
        rows.append(row)
    return pd.DataFrame(rows)


DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def raw_from_database(tracking_uri: str, experiment_id: str, parent: str | None) -> Any:
    """The same rows as ``raw_from_search``, read from MLflow's tables in four queries; None
    when the store is not a database or its tables are not the ones expected."""
    scheme = tracking_uri.partition(":")[0].partition("+")[0]
    if scheme not in DATABASE_SCHEMES:
        return None
    import sqlalchemy as sa
    from sqlalchemy.exc import SQLAlchemyError

    trials = (
        "SELECT r.run_uuid, r.start_time FROM runs r "
        "JOIN tags role ON role.run_uuid = r.run_uuid AND role.key = :role_key "
        "AND role.value = :role "
        + (
            "JOIN tags parent ON parent.run_uuid = r.run_uuid AND parent.key = :parent_key "
            "AND parent.value = :parent "
            if parent is not None
            else ""
        )
        + "WHERE r.experiment_id = :experiment AND r.lifecycle_stage = 'active'"
    )
    binds = {
        "role_key": ROLE_TAG,
        "role": TRIAL_ROLE,
        "parent_key": PARENT_TAG,
        "parent": parent,
        "experiment": int(experiment_id),
    }
    if parent is None:
        binds.pop("parent")

    def query(sql: str) -> pd.DataFrame:
        return pd.read_sql(sa.text(sql), connection, params=binds)

    engine = sa.create_engine(tracking_uri)
    try:
        with engine.connect() as connection:
            runs = query(trials + " ORDER BY r.start_time, r.run_uuid")
            within = f"JOIN ({trials}) t ON t.run_uuid = x.run_uuid"
            params = query(f"SELECT x.run_uuid, x.key, x.value FROM params x {within}")
            tags = query(f"SELECT x.run_uuid, x.key, x.value FROM tags x {within}")
            metrics = query(
                f"SELECT x.run_uuid, x.key, x.value, x.is_nan FROM latest_metrics x {within}"
            )
    except SQLAlchemyError:  # not MLflow's schema as this code knows it
        return None
    finally:
        engine.dispose()
    metrics = metrics[~metrics["key"].isin(HISTORY_METRICS)]
    metrics.loc[metrics["is_nan"].astype(bool), "value"] = float("nan")
    tags = tags[tags["key"].isin([*TAG_COLUMNS, PARENT_TAG])]
    wide: list[pd.DataFrame | pd.Series] = [
        table.pivot(index="run_uuid", columns="key", values="value")
        for table in (params, tags, metrics)
        if len(table)
    ]
    frame = runs.set_index("run_uuid").join(wide) if wide else runs.set_index("run_uuid")
    frame = frame.rename(columns={PARENT_TAG: "sweep_run_id"}).reset_index(names="run_id")
    frame.columns.name = None
    frame["start_time"] = pd.to_datetime(frame["start_time"], unit="ms", utc=True)
    for column in (*TAG_COLUMNS, "sweep_run_id"):
        if column not in frame:
            frame[column] = None
    return frame


@dataclass
class Sweep:
    """A sweep's trials plus what its parent run knows (name, budget, objectives)."""

    frame: pd.DataFrame
    experiment: str
    parent_run_id: str
    params: dict[str, str]
    tracking_uri: str

    @property
    def device_memory(self) -> float | None:
        value = self.params.get("device_memory_bytes")
        return float(value) if value else None


def load_sweep(
    experiment: str | None = None,
    tracking_uri: str = DEFAULT_MLFLOW_URI,
    sweep: str = "latest",
) -> Sweep:
    """Like ``load``, with the sweep's parent run (for ``sweep="all"``: the latest one)."""
    frame = load(experiment, tracking_uri, sweep)
    client = _client(tracking_uri)
    if sweep in ("latest", "all"):
        _, parent = find_sweep(client, experiment)
    else:
        parent = client.get_run(_sweep_by_id(client, sweep, experiment)[1])
    name = client.get_experiment(parent.info.experiment_id).name
    return Sweep(frame, name, parent.info.run_id, dict(parent.data.params), tracking_uri)


def tidy(frame: pd.DataFrame) -> pd.DataFrame:
    """Untyped trial rows -> the results table: fixed leading columns, proper dtypes."""
    frame = frame.copy()
    for column in ID_COLUMNS + list(METRICS):
        if column not in frame:
            frame[column] = pd.NA
    for column in frame.columns:
        if column in INT_PARAMS or column.startswith(KNOB_PREFIX):
            numeric = pd.to_numeric(frame[column], errors="coerce")
            if column.startswith(KNOB_PREFIX):
                if (frame[column].notna() & numeric.isna()).any():
                    continue  # a non-numeric knob (a name, a path) stays text
                if not (numeric.dropna() % 1 == 0).all():
                    frame[column] = numeric.astype("float64")  # drop_path_rate: 0.1
                    continue
            if ((numeric < -(2**63)) | (numeric >= 2**63)).any():
                # Beyond int64 (an old record of a spec validation now refuses): the column
                # stays float64 rather than the whole table failing to load, now and forever.
                frame[column] = numeric.astype("float64")
                continue
            frame[column] = numeric.astype("Int64")
        elif column in BOOL_PARAMS:
            frame[column] = frame[column].map({"True": True, "False": False}).astype("boolean")
        elif column in FLOAT_PARAMS or column in METRICS or column == "trial_wall_time_s":
            frame[column] = pd.to_numeric(frame[column], errors="coerce").astype("float64")
    frame["failure_reason"] = frame["failure_reason"].fillna("")
    rest = sorted(c for c in frame.columns if c not in ID_COLUMNS and c not in METRICS)
    return frame[ID_COLUMNS + list(METRICS) + rest].reset_index(drop=True)


def trial_timeline(tracking_uri: str, run_id: str) -> dict[str, Any] | None:
    """A trial run's memory timeline (its ``trial/timeline.json`` artifact), or None when it has
    none (it ended before its memory window, or ran with ``measure.timeline: false``)."""
    from mlflow.exceptions import MlflowException

    client = _client(tracking_uri)
    with tempfile.TemporaryDirectory() as folder:
        try:
            path = client.download_artifacts(run_id, f"trial/{TIMELINE_FILE}", folder)
            return json.loads(Path(path).read_text())
        except (MlflowException, OSError, ValueError):
            return None


MIN_KEY_PREFIX = 4  # characters of a trial_key that may name a trial (tables show 8)


def find_trial(sweep: Sweep, name: str) -> pd.Series:
    """The trial ``name`` means in ``sweep.frame`` (the latest run of it): a run id, a trial_key,
    a prefix of one trial_key (at least ``MIN_KEY_PREFIX`` characters, as tables print them),
    or the MLflow run name the sweep gave it (``small bs=32 fp32 none``; one that several
    sweeps share means this sweep's). ``ResultsError`` when none or several trials match."""
    frame = sweep.frame
    found = frame[(frame["run_id"] == name) | (frame["trial_key"] == name)]
    if found.empty and len(name) >= MIN_KEY_PREFIX:
        found = frame[frame["trial_key"].astype(str).str.startswith(name)]
    if found.empty:  # run names have spaces ("s bs=8 fp32 none"): never a key or its prefix
        named = frame[frame["run_id"].isin(runs_named(sweep, name))]
        in_this_sweep = named[named["sweep_run_id"] == sweep.parent_run_id]
        found = in_this_sweep if not in_this_sweep.empty else named
    if found.empty:
        short = (
            f"; a key prefix needs {MIN_KEY_PREFIX}+ characters"
            if 0 < len(name) < MIN_KEY_PREFIX
            else ""
        )
        raise ResultsError(
            f"no trial with run id or trial key {name!r} (or a key prefix, or a run name) in "
            f"experiment {sweep.experiment!r}{short} (see the trial column of harness results)"
        )
    keys = found.drop_duplicates("trial_key", keep="last")
    if len(keys) > 1:
        listed = ", ".join(
            f"{row['trial_key']} ({row['model_size']} bs={row['batch_size']} {row['dtype']} "
            f"{row['strategy']})"
            for _, row in keys.head(6).iterrows()
        )
        more = f" and {len(keys) - 6} more" if len(keys) > 6 else ""
        raise ResultsError(
            f"{name!r} names {len(keys)} trials: {listed}{more}; give more of the trial key"
        )
    return found.sort_values("start_time").iloc[-1]


def runs_named(sweep: Sweep, name: str) -> list[str]:
    """Run ids of the sweep's experiment's trial runs whose MLflow run name is ``name``, or
    ``name`` and the sweep's short id after it (``s bs=8 fp32 none @3f9a1c2e``, as sweeps name
    their trials since they carry it)."""
    if not name.strip() or "'" in name:  # no filter string quotes it; no trial is named so
        return []
    client = _client(sweep.tracking_uri)
    found = client.get_experiment_by_name(sweep.experiment)
    if found is None:
        return []
    # LIKE reads % and _ as wildcards: the names are compared exactly below.
    runs = all_runs(
        client,
        [found.experiment_id],
        f"attributes.run_name LIKE '{name}%' and tags.{ROLE_TAG} = '{TRIAL_ROLE}'",
        ["attributes.start_time ASC"],
    )
    return [
        run.info.run_id
        for run in runs
        if run.info.run_name == name or run.info.run_name.startswith(f"{name} @")
    ]


def select_sweep(selector: str, tracking_uri: str = DEFAULT_MLFLOW_URI) -> Sweep:
    """One recorded sweep named the way ``harness compare`` takes them (docs/results.md,
    "Naming a sweep"): ``EXPERIMENT`` (its latest sweep), ``EXPERIMENT@RUN_ID`` (a sweep by
    its parent run id, or the first 6+ characters of it) or ``EXPERIMENT@DEVICE`` (the latest
    sweep of the experiment whose trials ran on a device whose name contains DEVICE, any case:
    ``gpt@h100``, ``gpt@AMD EPYC``)."""
    experiment, at, which = selector.partition("@")
    if not experiment:
        raise ResultsError(f"{selector!r}: name an experiment, e.g. digits-cnn@h100")
    if not at:
        return load_sweep(experiment, tracking_uri)
    if not which:
        raise ResultsError(f"{selector!r}: after '@' give a sweep's run id or a device name")
    every = load(experiment, tracking_uri, sweep="all")
    sweeps = every.dropna(subset=["sweep_run_id"])
    ids = [run_id for run_id in sweeps["sweep_run_id"].unique() if str(run_id).startswith(which)]
    if len(ids) == 1 and len(which) >= 6:
        return load_sweep(experiment, tracking_uri, str(ids[0]))
    names = sweeps["device_name"].fillna("").astype(str)
    on_device = sweeps[names.str.lower().str.contains(which.lower(), regex=False)]
    if on_device.empty:
        seen = sorted({n for n in names if n})
        raise ResultsError(
            f"{selector!r}: no sweep of {experiment!r} has run id {which!r} or ran on a device "
            f"named like it (devices recorded: {', '.join(seen) or 'none'})"
        )
    latest = on_device.sort_values("start_time").iloc[-1]["sweep_run_id"]
    return load_sweep(experiment, tracking_uri, str(latest))
