"""MLflow recording and the results table, on a real temporary SQLite store."""

from __future__ import annotations

import time

import pytest

from harness.results import ResultsError, load
from harness.spec import parse_spec
from harness.tracking import PARENT_TAG, ROLE_TAG, TRIAL_ROLE, Tracker


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri, "exp", tmp_path / "artifacts")
    parent = tracker.open_sweep(None, "sweep exp", tags={}, params={"n_trials": "1"})
    return uri, tracker, parent, tmp_path


def record(tracker, parent, workdir, config, status="ok", metrics=None):
    workdir.mkdir(exist_ok=True)
    (workdir / "config.json").write_text(config.to_json())
    result = {
        "trial_key": config.trial_key,
        "status": status,
        "failure_reason": "" if status == "ok" else "why",
        "metrics": metrics or {},
        "loss_history": [2.0, 1.5, float("nan")],
        "info": {"device": "cpu", "torch_threads": 2},
    }
    return tracker.log_trial(parent, config, result, workdir, int(time.time() * 1000), "label")


def test_trial_run_round_trips_to_a_typed_row(store, base_spec):
    uri, tracker, parent, folder = store
    base_spec["train"]["optimizer"] = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
    config = parse_spec(base_spec).trials()[0]
    run_id = record(
        tracker,
        parent,
        folder / "t1",
        config,
        metrics={"throughput": 123.5, "peak_allocated_bytes": 4096.0},
    )
    frame = load("exp", uri)
    row = frame.iloc[0]
    assert row["run_id"] == run_id and row["sweep_run_id"] == parent
    assert row["trial_key"] == config.trial_key and row["status"] == "ok"
    assert row["batch_size"] == 32 and str(frame["batch_size"].dtype) == "Int64"
    assert row["throughput"] == 123.5 and frame["throughput"].dtype == "float64"
    assert row["momentum"] == 0.9 and not row["foreach"] and row["torch_threads"] == 2
    assert row["knob_width"] == 16 and row["model"] == "mlp" and row["strategy"] == "none"
    assert "train_loss_step" not in frame  # a per-step history, not a column
    history = tracker.client.get_metric_history(run_id, "train_loss_step")
    assert [m.step for m in history] == [0, 1, 2] and history[0].value == 2.0
    artifacts = [a.path for a in tracker.client.list_artifacts(run_id, "trial")]
    assert artifacts == ["trial/config.json"]


def test_half_written_trial_is_not_recorded_and_is_discarded(store, base_spec):
    _, tracker, parent, folder = store
    config = parse_spec(base_spec).trials()[0]
    # What a sweep killed between creating a trial's run and terminating it leaves behind.
    tracker.client.create_run(
        tracker.experiment_id,
        tags={
            ROLE_TAG: TRIAL_ROLE,
            PARENT_TAG: parent,
            "trial_key": config.trial_key,
            "status": "ok",
        },
    )
    assert tracker.recorded_trials(parent) == {}
    assert tracker.discard_unfinished_trials(parent) == 1
    assert tracker.trial_runs(parent) == []
    record(tracker, parent, folder / "t1", config, status="oom")
    assert tracker.recorded_trials(parent) == {config.trial_key: "oom"}


def test_reopening_a_sweep_keeps_its_parent_run(store):
    _, tracker, parent, _ = store
    tracker.close_sweep(parent, {"trials_ok": 1.0})
    assert tracker.open_sweep(parent, "sweep exp", tags={}, params={}) == parent
    assert tracker.client.get_run(parent).info.status == "RUNNING"
    assert tracker.open_sweep("0" * 32, "sweep exp", tags={}, params={}) != parent


def test_results_errors_name_what_is_missing(store, tmp_path):
    uri, *_ = store
    with pytest.raises(ResultsError, match=r"no experiment named 'nope'.*recorded: exp"):
        load("nope", uri)
    with pytest.raises(ResultsError, match="not a sweep"):
        load("exp", uri, sweep=_a_trial_run(store))
    with pytest.raises(ResultsError, match="no MLflow store"):
        load(None, f"sqlite:///{tmp_path}/missing.db")


def _a_trial_run(store):
    tracker = store[1]
    run = tracker.client.create_run(tracker.experiment_id, tags={ROLE_TAG: TRIAL_ROLE})
    return run.info.run_id
