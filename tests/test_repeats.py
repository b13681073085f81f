"""``train.repeats``: a trial run N times, its throughput the median of the runs and their
range recorded beside it; the noise rule's interval spans the range. The sweep runs for real
(a tiny MLP on digits, a temporary SQLite store); ``repeated`` is tested as the pure function
it is on real ``TrialResult`` objects."""

from __future__ import annotations

import copy

import pytest

from harness.analyse.noise import throughput_interval, throughputs_tie
from harness.record.results import load
from harness.sweep.repeats import repeated
from harness.trial.result import Status, TrialResult
from tests.conftest import BASE_SPEC, expect_exit, run_cli, write_spec


def result(throughput: float | None) -> TrialResult:
    metrics = {} if throughput is None else {"throughput": throughput, "step_time_cv": 0.01}
    return TrialResult(trial_key="k", status=Status.OK, metrics=metrics)


def test_the_median_is_recorded_with_the_range_of_the_runs():
    first = repeated(result(100.0), [result(140.0), result(90.0)])
    assert first.metrics["throughput"] == 100.0
    assert (first.metrics["throughput_min"], first.metrics["throughput_max"]) == (90.0, 140.0)
    assert first.metrics["repeats"] == 3.0
    # A run that measured nothing (it crashed) is left out; one run alone is left as it was.
    alone = repeated(result(100.0), [result(None)])
    assert alone.metrics == {"throughput": 100.0, "step_time_cv": 0.01}


def test_the_interval_spans_the_runs():
    """Two configurations 20 % apart tie when their runs overlap, not when they do not."""
    steady = {"throughput": 1000.0, "step_time_cv": 0.01}
    other = {"throughput": 800.0, "step_time_cv": 0.01}
    assert not throughputs_tie(steady, other)
    spread = {**steady, "throughput_min": 760.0, "throughput_max": 1100.0, "repeats": 3}
    assert throughput_interval(spread) == pytest.approx((760.0, 1100.0))
    assert throughputs_tie(spread, other)


@pytest.mark.slow
def test_a_sweep_runs_each_trial_as_often_as_asked(tmp_path):
    data = copy.deepcopy(BASE_SPEC)
    data["train"]["repeats"] = 3
    spec = write_spec(tmp_path, data)
    expect_exit(run_cli("sweep", str(spec), cwd=tmp_path), 0)
    row = load("unit", f"sqlite:///{tmp_path}/results/mlflow.db").iloc[0]
    assert row["status"] == "ok" and row["repeats"] == 3
    assert row["throughput_min"] <= row["throughput"] <= row["throughput_max"]
    assert row["throughput_min"] > 0
    trials = tmp_path / "results" / "unit" / "trials"
    assert [path.name for path in trials.iterdir()] == [row["trial_key"]]  # no repeat left
    # A bad value is one line naming the field, before any trial.
    data["train"]["repeats"] = 0
    done = run_cli("validate", str(write_spec(tmp_path, data, "bad.yaml")), cwd=tmp_path)
    assert done.returncode != 0 and "train.repeats" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr
