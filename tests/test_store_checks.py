"""Every broken store is one line: an unreachable server, a missing database, an MLflow file
store, a cut-short or damaged SQLite file, a journal that is not Optuna's. Each drill runs the
real CLI on real stores and wants exit code 2, at most 3 lines, no traceback, the store named,
an answer within seconds, and the broken file left exactly as it was."""

from __future__ import annotations

import copy
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from harness.record import store_checks
from harness.record.store_checks import (
    journal_problem,
    storage_problem,
    tracking_problem,
)
from harness.record.stores import initialise_mlflow_store, prepare_store
from tests.conftest import BASE_SPEC, REPO, expect_exit, free_port, run_cli, write_spec
from tests.test_workers import SERVER, fresh_database, postgres_up  # noqa: F401

# A broken store answers within this, the CLI's start-up included: room for a loaded machine
# (a second suite beside this one), and still far from the ~4 minutes of MLflow's retries.
ANSWER_S = 60


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A real MLflow store and a real Optuna storage (SQLite), made once; tests break copies."""
    import optuna

    folder = tmp_path_factory.mktemp("stores")
    mlflow_db, optuna_db = folder / "mlflow.db", folder / "optuna.db"
    prepare_store(f"sqlite:///{mlflow_db}", initialise_mlflow_store)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{optuna_db}")
    study.enqueue_trial({"x": 1})
    return {"mlflow": mlflow_db, "optuna": optuna_db}


def cut_short(source: Path, target: Path) -> bytes:
    """``target``: the first half of ``source`` (a copy killed mid-write); its bytes."""
    data = source.read_bytes()[: source.stat().st_size // 2]
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    return data


def one_line_exit_2(done: subprocess.CompletedProcess[str], elapsed: float, *named: str) -> str:
    output = (done.stdout + done.stderr).strip()
    expect_exit(done, 2)
    assert "Traceback" not in output, output
    assert len(output.splitlines()) <= 3, output
    for text in named:
        assert text in output, output
    assert elapsed < ANSWER_S, f"{elapsed:.1f} s: {output}"
    return output


def drill(*args: str, cwd: Path, named: tuple[str, ...] = ()) -> str:
    started = time.monotonic()
    done = run_cli(*args, cwd=cwd, timeout=120)
    return one_line_exit_2(done, time.monotonic() - started, *named)


def sweep_spec(folder: Path, **tracking: str) -> Path:
    data: dict[str, Any] = copy.deepcopy(BASE_SPEC)
    data["tracking"] = tracking
    return write_spec(folder, data)


def no_trial_ran(folder: Path) -> bool:
    return not list(folder.glob("results/*/trials/*"))


# ---- the read commands -------------------------------------------------------------------------

READ_COMMANDS = [
    ["results"],
    ["pareto", "--no-plots"],
    ["report"],
    ["recommend", "--budget", "1GiB"],
    ["timeline", "abcd"],
]


@pytest.mark.parametrize("command", READ_COMMANDS, ids=lambda c: c[0])
def test_an_unreachable_server_is_one_line_on_every_read_command(tmp_path, command):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    output = drill(*command, "--tracking-uri", uri, cwd=tmp_path, named=("--tracking-uri", uri))
    assert "refused" in output


def test_a_silent_server_is_reported_naming_the_limit_it_ran_past(monkeypatch):
    """A server that takes the connection and never answers: the check says which limit it hit
    (its 15 s, here shortened), not a bare "timed out"."""
    import socket

    monkeypatch.setattr(store_checks, "TIMEOUT_S", 0.5)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # the kernel completes the connection; nobody ever reads or answers
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        why = store_checks.http_problem(uri)
    assert why == "no answer on /health within the 0.5 s limit of the store check"


@pytest.mark.skipif(not postgres_up(), reason="no PostgreSQL server at 127.0.0.1:5432")
def test_a_missing_postgres_database_is_one_line(tmp_path):
    uri = f"{SERVER}/harness_missing_db"
    output = drill("results", "--tracking-uri", uri, cwd=tmp_path, named=(uri,))
    assert 'database "harness_missing_db" does not exist' in output
    spec = sweep_spec(tmp_path, mlflow_uri=uri)
    drill("sweep", str(spec), cwd=tmp_path, named=("tracking.mlflow_uri", uri))
    assert no_trial_ran(tmp_path)


@pytest.mark.skipif(not postgres_up(), reason="no PostgreSQL server at 127.0.0.1:5432")
def test_a_read_never_makes_mlflow_tables_in_an_empty_database(tmp_path, fresh_database):  # noqa: F811
    import psycopg

    output = drill("results", "--tracking-uri", fresh_database, cwd=tmp_path)
    assert "holds no MLflow store" in output and "s3cret" not in output  # password hidden
    with psycopg.connect(fresh_database) as connection:
        (tables,) = connection.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'"
        ).fetchone()
    assert tables == 0
    # The same empty database is a fine new store for a sweep, of either kind.
    assert tracking_problem(fresh_database) is None
    assert storage_problem(fresh_database) is None


def test_an_mlflow_file_store_is_one_line_and_is_not_created(tmp_path):
    folder = tmp_path / "mlruns"
    uri = f"file://{folder}"
    output = drill("results", "--tracking-uri", uri, cwd=tmp_path, named=(uri,))
    assert "MLFLOW_ALLOW_FILE_STORE" in output and "sqlite:///" in output
    drill("sweep", str(sweep_spec(tmp_path, mlflow_uri=uri)), cwd=tmp_path, named=(uri,))
    assert not folder.exists() and no_trial_ran(tmp_path)


def test_a_missing_sqlite_store_is_not_created_by_a_read(tmp_path):
    done = run_cli("results", "--tracking-uri", f"sqlite:///{tmp_path}/none.db", cwd=tmp_path)
    assert done.returncode != 0 and "no MLflow store at" in done.stderr
    assert not (tmp_path / "none.db").exists()


def test_a_cut_short_mlflow_store_is_one_line_and_left_alone(tmp_path, stores):
    database = tmp_path / "results" / "mlflow.db"
    before = cut_short(stores["mlflow"], database)
    for command in (["results"], ["pareto", "--no-plots"]):
        output = drill(*command, cwd=tmp_path, named=("--tracking-uri", "results/mlflow.db"))
        assert "damaged" in output and "backup" in output
    output = drill("sweep", str(sweep_spec(tmp_path)), cwd=tmp_path, named=("tracking.mlflow_uri",))
    assert "damaged" in output
    assert database.read_bytes() == before
    assert not (tmp_path / "results" / "optuna.db").exists() and no_trial_ran(tmp_path)


@pytest.mark.parametrize("breakage", ["cut short", "garbage", "foreign"])
def test_a_broken_optuna_storage_is_one_line_and_left_alone(tmp_path, stores, breakage):
    database = tmp_path / "results" / "optuna.db"
    database.parent.mkdir()
    if breakage == "cut short":
        before = cut_short(stores["optuna"], database)
    elif breakage == "garbage":
        before = os.urandom(3000)
        database.write_bytes(before)
    else:  # another program's database where the study should be
        shutil.copy(stores["mlflow"], database)
        before = database.read_bytes()
    output = drill("sweep", str(sweep_spec(tmp_path)), cwd=tmp_path, named=("tracking.storage",))
    expected = {
        "cut short": "damaged",
        "garbage": "not a SQLite database",
        "foreign": "not an Optuna storage",
    }
    assert expected[breakage] in output
    if breakage != "foreign":
        assert "MLflow" in output and "move the file aside" in output
    assert database.read_bytes() == before and no_trial_ran(tmp_path)


def test_a_journal_that_is_not_optunas_is_one_line(tmp_path):
    journal = tmp_path / "study.journal"
    journal.write_bytes(b"\x00\xbb" + os.urandom(2000) + b"\n")
    before = journal.read_bytes()
    spec = sweep_spec(tmp_path, storage=f"journal:{journal}")
    output = drill("sweep", str(spec), cwd=tmp_path, named=("tracking.storage", str(journal)))
    assert "not an Optuna journal" in output
    assert journal.read_bytes() == before and no_trial_ran(tmp_path)


def test_damage_found_after_the_check_is_still_one_line(tmp_path, stores, monkeypatch):
    """Past the cheap check (quick_check off here, as for a large file) the damage shows as a
    database error inside MLflow: the command still says one line naming the store."""
    database = tmp_path / "results" / "mlflow.db"
    database.parent.mkdir()
    shutil.copy(stores["mlflow"], database)
    with sqlite3.connect(database) as connection:
        try:
            pages = connection.execute(
                "SELECT pageno FROM dbstat WHERE name = 'experiments'"
            ).fetchall()
        except sqlite3.OperationalError:
            pytest.skip("this SQLite has no dbstat table")
    page_size = int.from_bytes(database.read_bytes()[16:18], "big")
    with database.open("r+b") as file:  # the experiments table's pages, not the schema
        for (page,) in pages:
            file.seek((page - 1) * page_size)
            file.write(b"\xff" * page_size)
    before = database.read_bytes()
    uri = f"sqlite:///{database}"
    assert "damaged" in (tracking_problem(uri, reading=True) or "")  # quick_check sees it
    monkeypatch.setattr(store_checks, "QUICK_CHECK_MAX_BYTES", 0)
    assert tracking_problem(uri, reading=True) is None  # the header and schema look fine
    code = (
        "import harness.record.store_checks as checks; checks.QUICK_CHECK_MAX_BYTES = 0; "
        "from harness.cli.main import main; main()"
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code, "results"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    output = one_line_exit_2(done, time.monotonic() - started, "--tracking-uri", "mlflow.db")
    assert "damaged" in output
    assert database.read_bytes() == before


# ---- the checks themselves -------------------------------------------------------------------


def test_healthy_and_new_stores_pass(tmp_path, stores):
    assert tracking_problem(f"sqlite:///{stores['mlflow']}", reading=True) is None
    assert storage_problem(f"sqlite:///{stores['optuna']}") is None
    assert tracking_problem(f"sqlite:///{tmp_path}/new.db") is None  # a sweep makes it
    empty = tmp_path / "empty.db"
    empty.touch()
    assert storage_problem(f"sqlite:///{empty}") is None  # SQLite's own empty database
    assert "empty file" in (tracking_problem(f"sqlite:///{empty}", reading=True) or "")
    assert "does not exist" in (tracking_problem(f"sqlite:///{tmp_path}/x.db", reading=True) or "")
    assert not (tmp_path / "new.db").exists() and not (tmp_path / "x.db").exists()


def test_an_optuna_journal_with_a_torn_last_line_is_refused_before_optuna_writes(tmp_path):
    import optuna
    from optuna.storages.journal import JournalFileBackend

    def journal(path: Path) -> optuna.storages.JournalStorage:
        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))

    path = tmp_path / "study.journal"
    optuna.create_study(study_name="s", storage=journal(path)).enqueue_trial({"x": 1})
    assert journal_problem(path) is None
    with path.open("ab") as file:
        file.write(b'{"op_code": 5, "worker_id"')  # a write cut short, a truncated copy
    assert "cut short (line" in (journal_problem(path) or "")
    # Why it is refused: Optuna reads past it, then appends its next record to the torn line,
    # and the journal no longer reads at all.
    copy = tmp_path / "copy.journal"
    copy.write_bytes(path.read_bytes())
    with pytest.raises(Exception) as broken:  # which error depends on the step it breaks
        optuna.load_study(study_name="s", storage=journal(copy)).enqueue_trial({"x": 2})
        optuna.load_study(study_name="s", storage=journal(copy))
    assert not isinstance(broken.value, AssertionError)
    with path.open("ab") as file:
        file.write(b"\n[1, 2]\n")  # a complete line that is no record
    assert "line" in (journal_problem(path) or "")


def test_only_a_stores_own_errors_become_its_one_line(tmp_path, stores, monkeypatch):
    monkeypatch.setattr(store_checks, "OPENED", {})
    uri = f"sqlite:///{stores['mlflow']}"
    store_checks.note_store("x.yaml: tracking.mlflow_uri", uri, "mlflow")
    try:
        sqlite3.connect(":memory:").execute("SELECT * FROM nowhere")
    except sqlite3.Error:
        try:
            raise RuntimeError("API failed")  # as MLflow wraps a database error
        except RuntimeError as error:
            wrapped = error
    line = store_checks.escaped_store_error(wrapped)
    assert line == f"x.yaml: tracking.mlflow_uri: cannot use {uri}: no such table: nowhere"
    try:
        sqlite3.connect(":memory:").execute("SELECT * FROM nowhere")
    except sqlite3.Error:
        try:
            raise ValueError("handled") from None  # the database error was dealt with
        except ValueError as error:
            handled = error
    assert store_checks.escaped_store_error(handled) is None
    assert store_checks.escaped_store_error(KeyError("x")) is None
