"""Several workers, one sweep: claims, dead workers, --workers N, and workers on PostgreSQL."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta

import optuna
import pytest
from optuna.trial import TrialState

from harness.record.stores import redact
from harness.results import load
from harness.sweep import claim
from tests.conftest import BASE_SPEC, REPO, expect_exit, mlflow_server_at, run_cli, write_spec

POINTS = {"batch_size": [8, 16, 32], "dtype": ["fp32", "bf16"], "strategy": ["none"]}


def study() -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(directions=["minimize"])


def test_of_two_claims_of_one_point_the_later_look_yields_whatever_the_numbers():
    shared = study()
    first, second = shared.ask(), shared.ask()
    # The earlier-numbered trial names the point only after the later one looked and kept
    # it (a slow worker): it must yield, or both would run the point.
    assert claim.claim_point(shared, second, "k") is True
    assert claim.claim_point(shared, first, "k") is False
    assert shared.trials[first.number].user_attrs["abandoned"] is True
    assert shared.trials[first.number].state == TrialState.FAIL
    assert shared.trials[second.number].state == TrialState.RUNNING


def test_two_claims_that_name_a_point_before_either_looks_never_both_keep_it():
    shared = study()
    first, second = shared.ask(), shared.ask()
    first.set_user_attr("trial_key", "k")  # named, not yet looked
    assert claim.claim_point(shared, second, "k") is False  # sees the first: yields
    assert claim.claim_point(shared, first, "k") is True  # the second stepped aside
    both = study()
    one, two = both.ask(), both.ask()
    one.set_user_attr("trial_key", "k")
    two.set_user_attr("trial_key", "k")
    # Both named it, then both look before either yields: both see it taken.
    assert claim.taken(both, one, "k") and claim.taken(both, two, "k")
    for trial in (one, two):  # and yield, as claim_point does
        trial.set_user_attr("abandoned", True)
        both.tell(trial, state=TrialState.FAIL)
    assert claim.claim_point(both, both.ask(), "k") is True  # free again: the next look takes it


def test_a_finished_point_is_taken_but_a_dead_workers_point_is_free():
    shared = study()
    done = shared.ask()
    claim.claim_point(shared, done, "done")
    shared.tell(done, 1.0)
    assert claim.claim_point(shared, shared.ask(), "done") is False
    dead = shared.ask()
    dead.set_user_attr("trial_key", "free")
    shared.tell(dead, state=TrialState.FAIL)  # failed as a dead worker's: no status written
    assert claim.claim_point(shared, shared.ask(), "free") is True
    crashed = shared.ask()
    claim.claim_point(shared, crashed, "crashed")
    crashed.set_user_attr("status", "crash")  # a measured failure holds its point
    shared.tell(crashed, state=TrialState.FAIL)
    assert claim.claim_point(shared, shared.ask(), "crashed") is False


def test_passwords_are_not_printed():
    assert redact("postgresql://me:s3cret@db:5432/x") == "postgresql://me:***@db:5432/x"
    assert redact("http://127.0.0.1:5000") == "http://127.0.0.1:5000"


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_stale_running_trials_are_failed_and_live_ones_kept():
    shared = study()
    host = socket.gethostname()
    mine, gone, silent, remote = (shared.ask() for _ in range(4))
    mine.set_user_attr("owner", claim.owner())
    gone.set_user_attr("owner", f"{host}:{dead_pid()}")
    silent.set_user_attr("owner", "elsewhere:1")
    silent.set_user_attr("heartbeat", time.time() - 10 * claim.STALE_AFTER_S)
    remote.set_user_attr("owner", "elsewhere:2")
    remote.set_user_attr("heartbeat", time.time())
    assert claim.fail_stale_trials(shared) == 2
    states = [t.state for t in shared.trials]
    assert states == [TrialState.RUNNING, TrialState.FAIL, TrialState.FAIL, TrialState.RUNNING]
    # Failed without a status (the sweep writes one before it fails a measured trial): free.
    assert claim.released(shared.trials[1], {}) and claim.released(shared.trials[2], {})
    assert not claim.released(shared.trials[0], {})
    assert datetime.now() - shared.trials[1].datetime_complete < timedelta(minutes=1)


def test_heartbeat_writes_while_the_block_runs(monkeypatch):
    monkeypatch.setattr(claim, "HEARTBEAT_S", 0.05)
    shared = study()
    trial = shared.ask()
    trial.set_user_attr("heartbeat", 0.0)
    with claim.heartbeat(trial):
        time.sleep(0.3)
    assert shared.trials[0].user_attrs["heartbeat"] > time.time() - 5


def exactly_once(frame, points: int) -> None:
    assert len(frame) == points
    assert frame["trial_key"].is_unique
    assert set(frame["status"]) == {"ok"}


# `harness sweep --workers 2` end to end (every point once, both workers, the journal, the CPU
# warning) is tests/test_sweep_strategies.py: the every-strategy sweep runs on two workers.


@pytest.fixture
def mlflow_server(tmp_path):
    with mlflow_server_at(tmp_path) as url:
        yield url


SERVER = "postgresql://postgres@127.0.0.1:5432"
PASSWORD = "s3cret-pw"
SECRET_ENV = "never-logged-7c1f"


@pytest.fixture
def fresh_database():
    """A database of its own, so the workers also race to create Optuna's tables."""
    import psycopg

    name = f"harness_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(f"{SERVER}/test", autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    # Trust authentication ignores the password: it is there to prove it is never logged.
    yield f"postgresql://postgres:{PASSWORD}@127.0.0.1:5432/{name}"
    with psycopg.connect(f"{SERVER}/test", autocommit=True) as admin:
        admin.execute(f"DROP DATABASE {name} WITH (FORCE)")


def postgres_up() -> bool:
    try:
        socket.create_connection(("127.0.0.1", 5432), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not postgres_up(), reason="no PostgreSQL server at 127.0.0.1:5432")
def test_two_workers_on_postgresql_and_a_tracking_server(tmp_path, mlflow_server, fresh_database):
    name = "pg-workers"
    data = {**BASE_SPEC, "name": name, "grid": {**POINTS, "batch_size": [8, 16]}}
    data["train"] = {**BASE_SPEC["train"], "budget": {"steps": 6}}
    spec_path = write_spec(tmp_path, data)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HARNESS_TEST_TOKEN": SECRET_ENV}
    command = [
        sys.executable, "-m", "harness", "worker", str(spec_path),
        "--storage", fresh_database, "--tracking-uri", mlflow_server,
    ]  # fmt: skip
    workers = [
        subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [worker.communicate(timeout=600)[0] for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], outputs
    exactly_once(load(name, mlflow_server), 4)
    ran = [output.count(" ok  peak ") for output in outputs]
    assert sum(ran) == 4, outputs
    assert not any(PASSWORD in output for output in outputs)  # printed URLs are redacted
    # Neither the storage password nor the environment reaches MLflow.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name(name)
    for run in client.search_runs([experiment.experiment_id]):
        recorded = " ".join([*run.data.params.values(), *run.data.tags.values()])
        assert PASSWORD not in recorded and SECRET_ENV not in recorded


@pytest.mark.parametrize(
    ("tracking", "field", "cause"),
    [
        ({"mlflow_uri": "http://127.0.0.1:9"}, "tracking.mlflow_uri", "refused"),
        ({"storage": "postgresql://postgres@127.0.0.1:9/test"}, "tracking.storage", "127.0.0.1"),
        ({"results_dir": "/proc/harness-results"}, "tracking.results_dir", ""),
        ({"mlflow_uri": "sqlite:////proc/harness/mlflow.db"}, "tracking.mlflow_uri", ""),
    ],
)
def test_unusable_stores_fail_fast_with_one_line(tmp_path, tracking, field, cause):
    data = {**BASE_SPEC, "tracking": tracking}
    started = time.monotonic()
    done = run_cli("sweep", str(write_spec(tmp_path, data)), cwd=tmp_path)
    expect_exit(done, 2)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f": {field}: cannot use " in lines[0], done.stderr
    assert cause in lines[0]
    assert time.monotonic() - started < 60
    assert not list(tmp_path.glob("results/*/trials/*"))  # no trial ran


def test_a_results_folder_inside_a_file_is_reported_not_a_traceback(tmp_path):
    (tmp_path / "blocker").write_text("a file, not a folder")
    data = {**BASE_SPEC, "tracking": {"results_dir": "blocker/results"}}
    done = run_cli("sweep", str(write_spec(tmp_path, data)), cwd=tmp_path)
    expect_exit(done, 2)
    assert "tracking.results_dir: cannot use blocker/results: Not a directory" in done.stderr
    assert "Traceback" not in done.stderr
