"""A store written before validation refused integers beyond int64 still loads.

Such a spec ran, its trial recorded ``timed_steps: 10000000000000000000``, and from then on every
table read from the store failed (``cannot safely cast non-equivalent uint64 to int64``): the
summary, ``harness results``, ``pareto``, ``report``. The record stays; the table must load."""

from __future__ import annotations

from dataclasses import replace

import pytest

from harness.record.tracking import Tracker
from harness.results import load
from harness.spec import parse_spec, trial_configs
from tests.conftest import expect_exit, record_trial, run_cli

TOO_LARGE = 10**19  # above 2**63 - 1: a uint64 to pandas

pytestmark = pytest.mark.slow  # a real MLflow store and two CLI runs


def record_old_sweep(folder, base_spec) -> str:
    """A real MLflow SQLite store (``results/mlflow.db`` under ``folder``, where the CLI looks)
    holding one ordinary trial and one whose timed_steps and a knob are beyond int64."""
    uri = f"sqlite:///{folder}/results/mlflow.db"
    (folder / "results").mkdir()
    tracker = Tracker(uri, "old", folder / "artifacts")
    parent = tracker.open_sweep(None, "sweep old", tags={}, params={"n_trials": "2"})
    base_spec["grid"]["batch_size"] = [16, 32]
    configs = trial_configs(parse_spec(base_spec))
    oversized = replace(
        configs[1],
        timed_steps=TOO_LARGE,
        model_knobs={**configs[1].model_knobs, "width": -TOO_LARGE},
    )
    for index, config in enumerate([configs[0], oversized]):
        metrics = {
            "throughput": 100.0 + index,
            "peak_allocated_bytes": 4096.0 * (1 + index),
            "accuracy": 0.5,
        }
        record_trial(tracker, parent, folder / f"t{index}", config, "ok", metrics, f"t{index}")
    return uri


def test_a_store_holding_an_int_beyond_int64_still_loads(tmp_path, base_spec):
    uri = record_old_sweep(tmp_path, base_spec)
    for via in ("auto", "mlflow"):  # the database read path and search_runs
        frame = load("old", uri, via=via).sort_values("batch_size")
        assert str(frame["timed_steps"].dtype) == "float64"  # the column that cannot be Int64
        assert frame["timed_steps"].tolist() == [3.0, float(TOO_LARGE)]
        assert frame["knob_width"].tolist() == [16.0, float(-TOO_LARGE)]
        assert str(frame["batch_size"].dtype) == "Int64"  # the others keep their dtype
        assert frame["batch_size"].tolist() == [16, 32]
    keys = load("old", uri)["trial_key"].tolist()
    done = run_cli("results", cwd=tmp_path)  # the table the issue found broken for good
    expect_exit(done)
    assert all(key[:8] in done.stdout for key in keys), done.stdout
    done = run_cli("results", "--columns", "timed_steps", cwd=tmp_path)
    expect_exit(done)
    assert "10,000,000,000,000,000,000" in done.stdout, done.stderr
