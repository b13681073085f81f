"""MLflow recording and the results table, on a real temporary SQLite store."""

from __future__ import annotations

import pytest

from harness.record.tracking import PARENT_TAG, ROLE_TAG, TRIAL_ROLE, Tracker
from harness.results import ResultsError, load
from harness.spec import parse_spec, trial_configs
from tests.conftest import record_trial


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri, "exp", tmp_path / "artifacts")
    parent = tracker.open_sweep(None, "sweep exp", tags={}, params={"n_trials": "1"})
    return uri, tracker, parent, tmp_path


def test_trial_run_round_trips_to_a_typed_row(store, base_spec):
    uri, tracker, parent, folder = store
    base_spec["train"]["optimizer"] = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
    config = trial_configs(parse_spec(base_spec))[0]
    run_id = record_trial(
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
    assert row["attempts"] == 1 and str(frame["attempts"].dtype) == "Int64"
    assert str(frame["device_memory_bytes"].dtype) == "Int64"
    assert row["momentum"] == 0.9 and not row["foreach"] and row["torch_threads"] == 2
    assert row["knob_width"] == 16 and row["model"] == "mlp" and row["strategy"] == "none"
    assert "train_loss_step" not in frame  # a per-step history, not a column
    history = tracker.client.get_metric_history(run_id, "train_loss_step")
    assert [m.step for m in history] == [0, 1, 2] and history[0].value == 2.0
    artifacts = [a.path for a in tracker.client.list_artifacts(run_id, "trial")]
    assert artifacts == ["trial/config.json"]


def test_half_written_trial_is_not_recorded_and_is_discarded(store, base_spec):
    _, tracker, parent, folder = store
    config = trial_configs(parse_spec(base_spec))[0]
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
    record_trial(tracker, parent, folder / "t1", config, status="oom")
    assert tracker.recorded_trials(parent) == {config.trial_key: "oom"}


def test_a_dead_workers_finished_run_of_a_point_is_replaced_not_repeated(store, base_spec):
    _, tracker, parent, folder = store
    base_spec["grid"]["batch_size"] = [8, 16]
    first, other = trial_configs(parse_spec(base_spec))
    # The dead worker recorded its point and died before the study heard: the point ran again.
    record_trial(tracker, parent, folder / "t1", first)
    record_trial(tracker, parent, folder / "t2", other)
    assert tracker.discard_point(parent, first.trial_key) == 1
    record_trial(tracker, parent, folder / "t1", first)
    keys = [run.data.tags["trial_key"] for run in tracker.trial_runs(parent)]
    assert sorted(keys) == sorted([first.trial_key, other.trial_key])


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


def test_the_database_read_path_gives_search_runs_frame(store, base_spec):
    """``load`` reads MLflow's tables directly on a database store; it must give exactly the
    frame ``search_runs`` gives: two sweeps, knobs, failures, a NaN, a deleted run."""
    import pandas as pd

    from harness.record.results import raw_from_database

    uri, tracker, parent, folder = store
    base_spec["model"]["sizes"] = {"a": {"width": 8, "depth": 1}, "b": {"width": 16, "depth": 2}}
    base_spec["grid"]["batch_size"] = [16, 32]
    configs = trial_configs(parse_spec(base_spec))
    metrics = {"throughput": 10.0, "peak_allocated_bytes": 2048.0, "accuracy": 0.5}
    run_ids = [
        record_trial(tracker, parent, folder / f"t{i}", c, metrics={**metrics, "accuracy": i / 10})
        for i, c in enumerate(configs)
    ]
    tracker.client.log_metric(run_ids[0], "eval_loss", float("nan"))
    record_trial(tracker, parent, folder / "crash", configs[1], status="crash")
    tracker.client.delete_run(run_ids[1])
    second = tracker.open_sweep(None, "sweep exp", tags={}, params={"n_trials": "1"})
    record_trial(tracker, second, folder / "later", configs[2], metrics=metrics)
    for sweep in ("latest", "all", parent):
        fast, slow = load("exp", uri, sweep=sweep), load("exp", uri, sweep=sweep, via="mlflow")
        pd.testing.assert_frame_equal(fast, slow)
    every = load("exp", uri, sweep="all")
    assert len(every) == 5 and run_ids[1] not in set(every["run_id"])
    assert every.loc[every["run_id"] == run_ids[0], "eval_loss"].isna().all()
    assert raw_from_database("http://127.0.0.1:5000", "1", None) is None  # a server: search_runs


def test_long_loss_histories_are_kept_as_bucket_means():
    from harness.record.tracking import loss_curve

    assert loss_curve([3.0, 2.0, 1.0]) == [(0, 3.0), (1, 2.0), (2, 1.0)]
    ramp = [float(step) for step in range(2000)]
    curve = loss_curve(ramp, points=500)
    assert len(curve) == 500
    assert curve[0] == (3, 1.5) and curve[-1] == (1999, 1997.5)  # mean of steps 0-3, 1996-1999
    uneven = loss_curve([1.0] * 1001, points=500)
    assert len(uneven) == 500 and uneven[-1][0] == 1000 and {v for _, v in uneven} == {1.0}


def test_knobs_keep_their_kind_when_sizes_differ(store, base_spec):
    """A float knob (drop_path_rate: 0.1) is float64, an integer knob that one size lacks is
    still Int64, a name stays text: load() cast them all to Int64 once and crashed."""
    uri, tracker, parent, folder = store
    base_spec["model"] = {
        "family": "user_models:anything",
        "sizes": {"a": {"rate": 0.1, "depth": 2, "kind": "wide"}, "b": {"rate": 0.5}},
    }
    for index, config in enumerate(trial_configs(parse_spec(base_spec))):
        record_trial(tracker, parent, folder / f"t{index}", config)
    frame = load("exp", uri).set_index("model_size")
    assert str(frame["knob_rate"].dtype) == "float64" and frame.loc["a", "knob_rate"] == 0.1
    assert str(frame["knob_depth"].dtype) == "Int64" and frame["knob_depth"].isna().sum() == 1
    assert frame.loc["a", "knob_kind"] == "wide"
