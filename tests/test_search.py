"""Optuna search: what each trial tells the sampler, and a search that resumes and grows."""

from __future__ import annotations

import optuna
import pytest

from harness.results import load
from harness.spec import SweepPlan, parse_spec
from harness.sweep.plan import memory_constraint, objective_values, trials_to_run
from harness.trial.result import Status, TrialResult
from tests.conftest import BASE_SPEC, expect_exit, run_cli, write_spec


def result(status: str, **metrics: float) -> TrialResult:
    return TrialResult("k", Status(status), metrics=metrics)


def spec_with(**search):
    data = {**BASE_SPEC, "device_memory": "1MiB", "search": search}
    return parse_spec(data)


def test_over_budget_trials_tell_real_memory_and_zero_delivery():
    spec = spec_with()
    infeasible = result("infeasible", predicted_peak_bytes=3 * 2**20)
    assert objective_values(spec, infeasible) == [3 * 2**20, 0.0, 0.0]
    assert memory_constraint(spec, infeasible) == pytest.approx(2.0)
    ok = result("ok", peak_allocated_bytes=2**19, throughput=10.0, accuracy=0.5)
    assert objective_values(spec, ok) == [2**19, 10.0, 0.5]
    assert memory_constraint(spec, ok) == pytest.approx(-0.5)


def test_trials_without_values_are_failures():
    spec = spec_with()
    assert objective_values(spec, result("crash")) is None
    partial = result("diverged", peak_allocated_bytes=1.0, throughput=2.0)
    assert objective_values(spec, partial) is None


def test_an_oom_without_a_prediction_is_at_least_the_budget():
    spec = spec_with()
    assert objective_values(spec, result("oom")) == [2**20, 0.0, 0.0]
    assert memory_constraint(spec, result("oom")) > 0


def test_how_many_trials_a_run_adds():
    grid = parse_spec({**BASE_SPEC, "grid": {**BASE_SPEC["grid"], "batch_size": [8, 16, 32]}})
    assert trials_to_run(SweepPlan(grid), recorded=1, more=None) == 2
    data = {**BASE_SPEC, "grid": {**BASE_SPEC["grid"], "batch_size": [8, 16, 32, 64]}}
    optuna_spec = parse_spec({**data, "search": {"method": "optuna", "n_trials": 2}})
    assert trials_to_run(SweepPlan(optuna_spec), recorded=0, more=None) == 2
    assert trials_to_run(SweepPlan(optuna_spec), recorded=2, more=None) == 0
    assert trials_to_run(SweepPlan(optuna_spec), recorded=2, more=1) == 1
    assert trials_to_run(SweepPlan(optuna_spec), recorded=3, more=5) == 1  # the grid has 4 points


@pytest.mark.slow
def test_optuna_search_runs_n_trials_then_adds_more_without_repeats(tmp_path):
    """Also the search rebuilt from the records when its study is lost (one sweep more here
    rather than a search sweep of its own in test_sweep_identity.py)."""
    data = {
        **BASE_SPEC,
        "name": "searched",
        "model": {"family": "mlp", "sizes": {"a": {"width": 16, "depth": 1}}},
        "grid": {"batch_size": [8, 16, 32], "dtype": ["fp32", "bf16"], "strategy": ["none"]},
        "train": {**BASE_SPEC["train"], "budget": {"steps": 6}},
        "search": {"method": "optuna", "sampler": "tpe", "n_trials": 2},
    }
    path = write_spec(tmp_path, data)
    first = run_cli("sweep", str(path), cwd=tmp_path)
    expect_exit(first)
    again = run_cli("sweep", str(path), cwd=tmp_path)
    assert "Nothing left to run" in again.stdout
    more = run_cli("sweep", str(path), "--n-trials", "1", cwd=tmp_path)
    expect_exit(more)
    assert "2 of 3 trials already recorded" in more.stdout

    frame = load("searched", f"sqlite:///{tmp_path}/results/mlflow.db")
    assert len(frame) == 3
    assert frame["trial_key"].is_unique
    assert set(frame["status"]) == {"ok"}
    storage = f"sqlite:///{tmp_path}/results/optuna.db"
    (name,) = optuna.get_all_study_names(storage)
    study = optuna.load_study(study_name=name, storage=storage)
    measured = [t for t in study.trials if "repeat_of" not in t.user_attrs]
    assert len(measured) == 3
    assert {t.user_attrs["trial_key"] for t in measured} == set(frame["trial_key"])
    # No device_memory in this spec: every ok trial is feasible (constraint 0).
    assert all(t.constraints == {"memory": 0.0} for t in measured)

    # The study lost (deleted): rebuilt from the MLflow records, only a new point runs.
    (tmp_path / "results" / "optuna.db").unlink()
    rebuilt = expect_exit(run_cli("sweep", str(path), "--n-trials", "1", cwd=tmp_path))
    assert "3 recorded trial(s) of this sweep were missing from the study" in rebuilt.stdout
    frame = load("searched", f"sqlite:///{tmp_path}/results/mlflow.db")
    assert len(frame) == 4 and frame["trial_key"].is_unique  # the fourth point, once


def test_n_trials_flag_on_a_grid_spec_is_refused(tmp_path):
    path = write_spec(tmp_path, BASE_SPEC)
    done = run_cli("sweep", str(path), "--n-trials", "2", cwd=tmp_path)
    expect_exit(done, 2)
    assert "--n-trials needs search.method: optuna" in done.stderr
    assert "Traceback" not in done.stderr
