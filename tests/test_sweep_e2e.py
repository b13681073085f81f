"""End to end, as a user runs it: ``harness sweep`` -> trial processes -> MLflow -> pandas.

Slow (real trial processes, real SQLite stores in a temporary folder); CI runs them.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest

from harness.results import load
from tests.conftest import (
    BASE_SPEC,
    REPO,
    copy_fixture,
    expect_exit,
    output_tail,
    run_cli,
    wait_until,
    write_spec,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def faults_sweep(tmp_path_factory):
    """One sweep whose five trials end five different ways (run once, read by several tests)."""
    tmp_path = tmp_path_factory.mktemp("faults")
    base_spec = copy.deepcopy(BASE_SPEC)
    copy_fixture("faulty_models.py", tmp_path)
    base_spec["name"] = "faults"
    base_spec["model"] = {
        "family": "faulty_models:build",
        "sizes": {
            "ok": {"mode": "ok", "width": 16},
            "crash": {"mode": "crash"},
            "hang": {"mode": "hang"},
            "nan": {"mode": "nan"},
            "huge": {"mode": "ok", "width": 4096},
        },
    }
    base_spec["device_memory"] = "1MiB"
    # run_infeasible: train "huge" although predicted over budget, so its real peak says oom
    # (without it the trial is `infeasible` and never trained: tests/test_estimate.py).
    base_spec["limits"] = {"trial_timeout": "25s", "run_infeasible": True}
    spec_path = write_spec(tmp_path, base_spec)
    done = run_cli("sweep", str(spec_path), cwd=tmp_path)
    return tmp_path, spec_path, done


def test_every_failure_is_recorded_and_the_sweep_goes_on(faults_sweep):
    folder, _, done = faults_sweep
    # A crash or a timeout is no measurement: the sweep says so and exits 1 after its summary.
    expect_exit(done, 1)
    assert "exit status 1: 1 crash and 1 timeout (no measurement)" in done.stdout
    frame = load("faults", f"sqlite:///{folder}/results/mlflow.db").set_index("model_size")
    assert frame["status"].to_dict() == {
        "ok": "ok",
        "crash": "crash",
        "hang": "timeout",
        "nan": "diverged",
        "huge": "oom",
    }
    assert frame.loc["crash", "failure_reason"] == "killed by SIGSEGV"
    assert "25s trial_timeout" in frame.loc["hang", "failure_reason"]
    assert frame.loc["nan", "failure_reason"] == "training loss became nan at step 1"
    assert "exceeds device_memory 1.00 MiB" in frame.loc["huge", "failure_reason"]
    assert frame.loc["huge", "peak_allocated_bytes"] > 2**20
    assert frame.loc["ok", "accuracy"] > 0
    assert frame.loc["ok", "failure_reason"] == ""
    # The trial's log travels with its MLflow run.
    assert "Traceback" not in done.stdout
    assert "5 trials: 1 crash, 1 diverged, 1 ok, 1 oom, 1 timeout" in done.stdout


def test_optuna_study_records_every_grid_point(faults_sweep):
    import optuna

    folder, _, _ = faults_sweep
    summaries = optuna.get_all_study_summaries(f"sqlite:///{folder}/results/optuna.db")
    assert len(summaries) == 1
    study = optuna.load_study(
        study_name=summaries[0].study_name, storage=f"sqlite:///{folder}/results/optuna.db"
    )
    trials = study.get_trials()
    assert sorted(t.params["model_size"] for t in trials) == ["crash", "hang", "huge", "nan", "ok"]
    states = {t.params["model_size"]: t.state.name for t in trials}
    assert states["ok"] == "COMPLETE"
    assert all(t.user_attrs["mlflow_run_id"] for t in trials)


def test_results_cli_exports_numbers(faults_sweep):
    folder, _, _ = faults_sweep
    done = run_cli("results", "--format", "csv", cwd=folder)
    expect_exit(done)
    frame = pd.read_csv(io.StringIO(done.stdout))
    assert len(frame) == 5
    assert list(frame.columns[:13]) == [
        "trial_key", "status", "failure_reason", "model", "model_size", "batch_size", "dtype",
        "strategy", "optimizer", "dataset", "device", "world_size", "seed",
    ]  # fmt: skip
    for column in (
        "peak_allocated_bytes",
        "peak_rss_bytes",
        "throughput",
        "accuracy",
        "batch_size",
    ):
        assert pd.api.types.is_numeric_dtype(frame[column]), column
    parquet = folder / "out.parquet"
    assert (
        run_cli("results", "--format", "parquet", "--out", str(parquet), cwd=folder).returncode == 0
    )
    assert len(pd.read_parquet(parquet)) == 5


def test_results_cli_without_a_store_says_what_to_do(tmp_path):
    done = run_cli("results", cwd=tmp_path)
    expect_exit(done, 1)
    assert "run a sweep first" in done.stderr and "Traceback" not in done.stderr


def test_default_sweep_end_to_end(tmp_path):
    """What `make sweep` runs, in a scratch folder: 12+ ok trials comparing strategies,
    recorded in MLflow, the summary naming the best strategy per memory budget."""
    spec_path = tmp_path / "default.yaml"
    shutil.copy(REPO / "experiments" / "default.yaml", spec_path)
    done = run_cli("sweep", str(spec_path), cwd=tmp_path, timeout=900)
    expect_exit(done)
    frame = load(tracking_uri=f"sqlite:///{tmp_path}/results/mlflow.db")
    assert (frame["status"] == "ok").sum() >= 12
    assert frame["strategy"].nunique() >= 4
    # Every strategy learns the task (the optimizer swap at a learning rate of its own too).
    assert frame.groupby("strategy")["accuracy"].max().min() > 0.8
    summary = done.stdout.split("Best strategy per memory budget")[1]
    assert any(strategy in summary for strategy in frame["strategy"].unique())
    for column in (
        "peak_allocated_bytes", "peak_rss_bytes", "throughput", "accuracy", "mem_param_bytes",
        "mem_grad_bytes", "mem_optim_bytes", "mem_activation_bytes", "mem_other_bytes",
    ):  # fmt: skip
        assert frame[column].notna().all() and (frame[column] >= 0).all(), column
    with sqlite3.connect(tmp_path / "results" / "mlflow.db") as db:
        parents = db.execute(
            "select count(*) from tags where key='harness_role' and value='sweep'"
        ).fetchone()[0]
        children = db.execute(
            "select count(*) from tags where key='mlflow.parentRunId'"
        ).fetchone()[0]
    assert parents == 1 and children == len(frame) >= 12
    # Every ok trial's run carries its memory timeline, whose highest total is the trial's peak.
    artifacts = tmp_path / "results" / "mlartifacts" / "digits-cnn"
    for _, row in frame[frame["status"] == "ok"].iterrows():
        trial_files = artifacts / row["run_id"] / "artifacts" / "trial"
        timeline = json.loads((trial_files / "timeline.json").read_text())
        assert (trial_files / "timeline.png").stat().st_size > 5_000
        assert abs(max(timeline["samples"]["total"]) / row["peak_allocated_bytes"] - 1) <= 0.01


def test_rerun_resumes_without_repeating_or_duplicating(faults_sweep):
    """A second start of a finished sweep runs nothing (``--fresh``: the one-point sweep)."""
    folder, spec_path, _ = faults_sweep
    again = expect_exit(run_cli("sweep", str(spec_path), cwd=folder), 1)  # crash, timeout kept
    assert "5 of 5 trials already recorded" in again.stdout
    assert "Nothing left to run" in again.stdout
    frame = load("faults", f"sqlite:///{folder}/results/mlflow.db")
    assert len(frame) == 5 and frame["trial_key"].is_unique


def _recorded_trials(db: Path) -> int:
    """Trial runs in the MLflow store ``db`` now, read without taking a write lock."""
    if not db.exists():
        return 0
    try:
        with contextlib.closing(sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True)) as conn:
            query = "select count(*) from tags where key='mlflow.parentRunId'"
            return conn.execute(query).fetchone()[0]
    except sqlite3.OperationalError:  # tables not created yet, or locked by the writer now
        return 0


def _trial_processes(marker: str) -> list[psutil.Process]:
    """Trial processes (fresh, torchrun ranks, or forked from the warm zygote, whose command line
    is the zygote's) and zygotes: every ``harness.trial`` process working in ``marker``."""
    found = []
    for process in psutil.process_iter(["cmdline", "cwd"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        here = marker in cmdline or (process.info["cwd"] or "").startswith(marker)
        if "harness.trial" in cmdline and here:
            found.append(process)
    return found


def start_sweep(spec_path: Path, folder: Path, log: Path) -> subprocess.Popen:
    """``harness sweep SPEC`` in the background, in ``folder``, its output appended to ``log``
    (shown when the test fails)."""
    with log.open("ab") as output:
        return subprocess.Popen(
            [sys.executable, "-m", "harness", "sweep", str(spec_path)],
            cwd=folder,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=output,
            stderr=subprocess.STDOUT,
        )


def no_trial_left(marker: str, why: str) -> None:
    """Wait until no trial process of ``marker`` is left (an orphan checks its parent once a
    second; a loaded machine may take a while to end it); the test fails if one stays."""
    wait_until(lambda: not _trial_processes(marker), 60, f"{why}: every trial process gone")


def test_a_one_point_grid_sweeps_and_fresh_starts_a_second_sweep(tmp_path, base_spec):
    """Optuna's GridSampler alone fails on the last enqueued point; the sweep's sampler must not.
    ``--fresh`` then runs the point again as a new sweep beside the first; results show the
    latest sweep unless asked for all (a one-point sweep: the cheapest sweep to run twice)."""
    base_spec["name"] = "one-point"
    spec_path = write_spec(tmp_path, base_spec)
    store = f"sqlite:///{tmp_path}/results/mlflow.db"
    expect_exit(run_cli("sweep", str(spec_path), cwd=tmp_path))
    first = load("one-point", store)
    assert len(first) == 1 and (first["status"] == "ok").all()

    expect_exit(run_cli("sweep", str(spec_path), "--fresh", cwd=tmp_path))
    every = load("one-point", store, sweep="all")
    assert len(every) == 2 and every["sweep_run_id"].nunique() == 2
    assert every["trial_key"].nunique() == 1  # the same point, once per sweep
    latest = load("one-point", store)  # the latest sweep only
    assert len(latest) == 1 and latest["sweep_run_id"].iloc[0] != first["sweep_run_id"].iloc[0]


@pytest.mark.slow
def test_three_sigkills_at_random_moments_still_record_every_point_once(tmp_path, base_spec):
    """The sweep is killed (SIGKILL) three times, at moments drawn at random, then finishes:
    finished trials kept (not repeated, not duplicated in MLflow), interrupted ones re-run."""
    import random

    base_spec["name"] = "thrice"
    base_spec["grid"].update(batch_size=[8, 16, 32], dtype=["fp32", "bf16"])
    base_spec["train"]["budget"] = {"steps": 6}
    spec_path = write_spec(tmp_path, base_spec)
    draw = random.Random()
    # Each kill comes once the store holds `records` trials (0: while the sweep starts), a
    # random moment later: a condition, not a clock time, so that on a loaded machine (slow to
    # start a sweep) the kills still fall mid-sweep and not all during start-up.
    kills = [
        (records, round(draw.uniform(0, 2), 2)) for records in sorted(draw.sample(range(6), 3))
    ]
    db, log = tmp_path / "results" / "mlflow.db", tmp_path / "sweeps.log"
    for records, delay in kills:
        sweep = start_sweep(spec_path, tmp_path, log)

        def recorded_or_ended(sweep: subprocess.Popen = sweep, records: int = records) -> bool:
            return _recorded_trials(db) >= records or sweep.poll() is not None

        wait_until(recorded_or_ended, 300, f"{records} trial(s) recorded (kills {kills})")
        time.sleep(delay)  # the random moment itself, not a wait for something
        sweep.kill()  # SIGKILL: no cleanup code runs in the sweep
        sweep.wait()
        if sweep.returncode not in (0, -9):  # it ended by itself, and not as a finished sweep
            said = output_tail(log.read_text())
            pytest.fail(f"the sweep exited {sweep.returncode} (kills {kills})\n{said}")
        # An orphaned trial notices its sweep is gone and stops by itself.
        no_trial_left(str(tmp_path), f"kills {kills}")
    # (Kills before the first record leave nothing to resume: the last run then starts anew.)
    expect_exit(run_cli("sweep", str(spec_path), cwd=tmp_path))
    frame = load("thrice", f"sqlite:///{tmp_path}/results/mlflow.db", sweep="all")
    assert len(frame) == 6 and frame["trial_key"].is_unique, kills
    assert frame["sweep_run_id"].nunique() == 1
    assert (frame["status"] == "ok").all(), frame[["status", "failure_reason"]]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "status", "words"),
    [("crash_rank1", "crash", ""), ("hang", "timeout", "trial_timeout; killed")],
)
def test_a_multi_rank_trial_that_fails_leaves_no_rank_behind(tmp_path, mode, status, words):
    """One rank killed by a signal, or every rank hung: the whole trial ends, no orphans."""
    from harness.spec import parse_spec, trial_configs
    from harness.sweep.launch import launch_trial

    copy_fixture("faulty_models.py", tmp_path)
    data = copy.deepcopy(BASE_SPEC)
    data["model"] = {"family": "faulty_models:build", "sizes": {"f": {"mode": mode}}}
    data["grid"].update(batch_size=[16], strategy=["ddp:2"])
    spec = parse_spec(data, str(tmp_path / "spec.yaml"))
    config = trial_configs(spec)[0]
    # A hang is a timeout however long the ranks take to start: no need to wait long for it.
    result = launch_trial(config, tmp_path / "trial", timeout_s=12 if mode == "hang" else 30)
    assert result.status == status, result.failure_reason
    assert words in result.failure_reason
    no_trial_left(str(tmp_path), "a rank outlived its trial")


@pytest.mark.slow
def test_a_crash_is_retried_and_a_real_allocation_failure_is_oom(tmp_path, base_spec):
    copy_fixture("faulty_models.py", tmp_path)
    base_spec["name"] = "retried"
    base_spec["model"] = {
        "family": "faulty_models:build",
        "sizes": {"once": {"mode": "crash_once"}, "huge": {"mode": "huge"}},
    }
    base_spec["limits"] = {"retries": 1}
    done = run_cli("sweep", str(write_spec(tmp_path, base_spec)), cwd=tmp_path)
    expect_exit(done)
    frame = load("retried", f"sqlite:///{tmp_path}/results/mlflow.db").set_index("model_size")
    assert frame.loc["once", "status"] == "ok"  # crashed (SIGSEGV) once, then ran
    assert frame.loc["once", "attempts"] == 2
    assert frame.loc["huge", "status"] == "oom"  # the CPU allocator refused 1 PiB
    assert "can't allocate memory" in frame.loc["huge", "failure_reason"]
    assert frame.loc["huge", "attempts"] == 1  # oom is an answer, not retried
