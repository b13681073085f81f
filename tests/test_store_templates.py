"""A new MLflow store is a copy of an empty one built once per MLflow version: the copy must be
the store MLflow itself would have built here, table for table and row for row."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

from harness.record.stores import (
    TEMPLATE_ENV,
    initialise_mlflow_store,
    prepare_store,
    template_folder,
)


def _contents(path: Path) -> tuple[list[tuple[str, str]], dict[str, list[tuple[object, ...]]]]:
    """Every table's and index's SQL, and every table's rows (the Default experiment's dates
    left out: they are the moment it was made)."""
    with contextlib.closing(sqlite3.connect(path)) as database:
        statements = database.execute("SELECT name, sql FROM sqlite_master WHERE sql IS NOT NULL")
        # Lines sorted: MLflow's own builds list a table's CHECK constraints in varying order.
        schema = sorted((name, "\n".join(sorted(sql.splitlines()))) for name, sql in statements)
        tables = [name for name, sql in schema if "CREATE TABLE" in sql]
        rows = {}
        for table in tables:
            columns = [c[1] for c in database.execute(f"PRAGMA table_info('{table}')")]
            kept = [c for c in columns if c not in ("creation_time", "last_update_time")]
            rows[table] = sorted(database.execute(f"SELECT {', '.join(kept)} FROM '{table}'"))
    return schema, rows


def test_a_copied_store_is_the_store_mlflow_builds_here(tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"  # where the template is built: its folder must not leak
    elsewhere.mkdir()
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.setenv(TEMPLATE_ENV, str(tmp_path / "templates"))
    monkeypatch.chdir(elsewhere)
    prepare_store(f"sqlite:///{elsewhere}/first.db", initialise_mlflow_store)
    templates = list((tmp_path / "templates").glob("mlflow-*-empty.db"))
    assert len(templates) == 1, "the first store leaves one template for its MLflow version"

    monkeypatch.chdir(here)
    prepare_store(f"sqlite:///{here}/copied.db", initialise_mlflow_store)
    monkeypatch.setenv(TEMPLATE_ENV, "0")
    prepare_store(f"sqlite:///{here}/built.db", initialise_mlflow_store)

    copied, built = _contents(here / "copied.db"), _contents(here / "built.db")
    assert copied == built
    default = built[1]["experiments"][0]
    assert str(here / "mlruns") in str(default), default  # and the copy says the same


def test_an_unwritable_template_folder_builds_the_store_as_mlflow_does(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(TEMPLATE_ENV, str(blocker / "templates"))
    prepare_store(f"sqlite:///{tmp_path}/store.db", initialise_mlflow_store)
    with contextlib.closing(sqlite3.connect(tmp_path / "store.db")) as database:
        (count,) = database.execute("SELECT count(*) FROM experiments").fetchone()
    assert count == 1


def test_templates_can_be_turned_off_or_follow_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv(TEMPLATE_ENV, "0")
    assert template_folder() is None
    monkeypatch.setenv(TEMPLATE_ENV, "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert template_folder() == tmp_path / "harness" / "stores"
