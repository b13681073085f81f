"""A sweep is what MLflow recorded: recorded work never runs twice, whatever the study storage.

The drills of a new user: switching between ``--workers`` and a plain run (a journal file vs
SQLite), a deleted or emptied study, a start killed before the study named its parent run, a
later partial duplicate of a finished sweep, ``--dry-run`` on a recorded sweep, SIGTERM. Real
stores, real processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from harness.record.tracking import ROLE_TAG, STUDY_TAG, SWEEP_ROLE, TRIAL_ROLE, Tracker
from harness.results import load
from tests.conftest import BASE_SPEC, REPO, expect_exit, output_tail, run_cli, write_spec

GRID = {"batch_size": [16, 32], "dtype": ["fp32"], "strategy": ["none"]}


def spec_file(folder: Path, name: str, **changes: object) -> Path:
    data = {**BASE_SPEC, "name": name, "grid": GRID, **changes}
    data["train"] = {**BASE_SPEC["train"], "budget": {"steps": 4}}
    return write_spec(folder, data)


def store(folder: Path) -> str:
    return f"sqlite:///{folder}/results/mlflow.db"


def parent_runs(folder: Path, experiment: str) -> list:
    client = MlflowClient(tracking_uri=store(folder))
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id], f"tags.{ROLE_TAG} = '{SWEEP_ROLE}'")


def trial_runs(folder: Path, experiment: str) -> list:
    client = MlflowClient(tracking_uri=store(folder))
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id], f"tags.{ROLE_TAG} = '{TRIAL_ROLE}'")


def sweep(folder: Path, spec: Path, *options: str) -> subprocess.CompletedProcess[str]:
    done = run_cli("sweep", str(spec), *options, cwd=folder)
    expect_exit(done)
    return done


@pytest.mark.slow
def test_switching_storage_or_losing_the_study_never_runs_a_recorded_trial(tmp_path):
    spec = spec_file(tmp_path, "switch")
    first = sweep(tmp_path, spec, "--workers", "2")
    # One sweep, shown once: one header, trials numbered 1..2 by the sweep, not per worker.
    assert first.stdout.count("trial(s) to run") == 1
    assert "[1/2]" in first.stdout and "[2/2]" in first.stdout
    assert "start the worker" not in first.stdout + first.stderr
    results = tmp_path / "results"
    assert (results / "optuna.journal").exists()

    plain = sweep(tmp_path, spec)  # the plain run's study (SQLite) has never seen this sweep
    assert "2 recorded trial(s) of this sweep were missing from the study" in plain.stdout
    assert "Nothing left to run" in plain.stdout

    (results / "optuna.db").write_bytes(b"")  # emptied
    assert "Nothing left to run" in sweep(tmp_path, spec).stdout
    (results / "optuna.db").unlink()  # deleted
    assert "Nothing left to run" in sweep(tmp_path, spec).stdout
    (results / "optuna.journal").unlink()  # and back to workers, whose journal is gone
    again = sweep(tmp_path, spec, "--workers", "2")
    assert "Nothing left to run" in again.stdout
    assert "[1/" not in again.stdout  # no worker started, no trial ran

    assert len(trial_runs(tmp_path, "switch")) == 2
    assert len(parent_runs(tmp_path, "switch")) == 1
    frame = load("switch", store(tmp_path))
    assert len(frame) == 2 and frame["trial_key"].is_unique


# An Optuna search rebuilt from the records after its study was deleted runs only new points:
# tests/test_search.py (its search sweep, one start more).


@pytest.mark.slow
def test_a_killed_start_is_adopted_and_results_ignore_a_partial_duplicate(tmp_path):
    """What a kill between creating the parent run and writing it on the study leaves: a
    RUNNING parent run of this sweep that no study names. The next start resumes it. (The
    finished sweep then also serves the results-vs-partial-duplicate check: one sweep run.)"""
    spec = spec_file(tmp_path, "orphan")
    listed = run_cli("sweep", str(spec), "--dry-run", cwd=tmp_path)
    assert not (tmp_path / "results").exists()  # a dry run writes nothing
    keys = [line.split()[1] for line in listed.stdout.splitlines() if "{'model_size'" in line]
    assert len(keys) == 2
    from harness.spec import SweepPlan, load_spec
    from harness.sweep.plan import study_name
    from harness.trial.hardware import host_hardware

    identity = study_name(SweepPlan(load_spec(spec)).on_hardware(host_hardware("cpu")))
    tracker = Tracker(store(tmp_path), "orphan", tmp_path / "results" / "mlartifacts")
    orphan = tracker.open_sweep(None, "sweep orphan", {STUDY_TAG: identity}, {})
    done = sweep(tmp_path, spec)
    assert f"Resuming sweep run {orphan[:8]}" in done.stdout
    (parent,) = parent_runs(tmp_path, "orphan")
    assert parent.info.run_id == orphan and parent.info.status == "FINISHED"
    assert {run.data.tags["trial_key"] for run in trial_runs(tmp_path, "orphan")} == set(keys)

    marked = run_cli("sweep", str(spec), "--dry-run", cwd=tmp_path)
    assert marked.stdout.count("recorded (ok): will not run") == 2
    assert "2 of 2 point(s) recorded; 0 to run" in marked.stdout

    # Then what an earlier harness left when a start lost its study: a newer parent run of the
    # same sweep holding only part of it. Results show the finished sweep, not the newer one.
    partial = tracker.open_sweep(None, "sweep orphan", {STUDY_TAG: identity}, {})
    tracker.close_sweep(partial, {})
    assert load("orphan", store(tmp_path))["trial_key"].nunique() == 2
    shown = expect_exit(run_cli("results", "--format", "csv", cwd=tmp_path))
    assert len(shown.stdout.strip().splitlines()) == 3


@pytest.mark.slow
def test_sigterm_stops_like_ctrl_c_and_the_sweep_resumes(tmp_path):
    grid = {"batch_size": [8, 16, 32], "dtype": ["fp32"], "strategy": ["none"]}
    spec = spec_file(tmp_path, "term", grid=grid)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["PYTHONPATH"] = str(REPO)
    process = subprocess.Popen(
        [sys.executable, "-m", "harness", "sweep", str(spec)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    assert process.stdout is not None
    for line in process.stdout:  # stop it once its first trial is recorded
        lines.append(line)
        if line.startswith("[1/3]"):
            break
    else:  # it ended (or closed its output) before recording a trial
        process.wait(timeout=60)
        pytest.fail(
            f"the sweep exited {process.returncode} before its first trial\n"
            + output_tail("".join(lines)),
        )
    process.send_signal(signal.SIGTERM)
    rest, _ = process.communicate(timeout=60)
    assert process.returncode == 143, output_tail("".join(lines) + rest)
    assert "Terminated (SIGTERM). Finished trials are recorded" in rest
    assert "Traceback" not in rest
    done = sweep(tmp_path, spec)
    assert "Resuming sweep" in done.stdout
    frame = load("term", store(tmp_path))
    assert len(frame) == 3 and frame["trial_key"].is_unique
