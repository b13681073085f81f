"""The stores a sweep writes to: MLflow's tracking store and the Optuna study's storage.

Both default to SQLite files under ``results/``; many processes on one machine share a journal
file (``journal:PATH``), many machines a PostgreSQL database and an MLflow server. New SQLite
stores are built in a temporary file and renamed into place, so a sweep killed while one is
being created never leaves a half-built database; a new MLflow store is a copy of an empty one
built once per MLflow version (its migrations cost seconds). URLs are printed without their
password.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

JOURNAL_PREFIX = "journal:"


def quiet_mlflow() -> None:
    """MLflow logs schema migrations and store creation at INFO; users need none of it. Its
    usage telemetry (on by default in MLflow 3) is switched off unless the user decided
    otherwise through ``MLFLOW_DISABLE_TELEMETRY``: a sweep must work offline and not report
    on its users, and each recorded call pays for it.

    Call before using mlflow: its import configures the "mlflow" logger, which this quietens.
    """
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one line per file
    import mlflow  # noqa: F401  (configures its loggers, which we then quieten)

    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)


def prepare_store(uri: str, initialise: Callable[[str], object] | None = None) -> None:
    """Create a ``sqlite:///path.db`` store's folder and, if the file is new, its tables.

    The tables are built in a temporary file that is then linked into place, so a sweep killed
    while a store is being created (schema migrations take seconds) never leaves a half-built
    database that the next run cannot open. Starts racing to create it each build their own
    file and the first link wins (a link never replaces a file, so no one's open database is
    swapped from under it). ``initialise(url)`` builds the tables.
    """
    parsed = urlparse(uri)
    if parsed.scheme != "sqlite":
        return
    raw = uri.removeprefix("sqlite:///")
    if not raw or raw == ":memory:":
        return
    path = Path(raw)
    path.parent.mkdir(parents=True, exist_ok=True)
    if initialise is None or path.exists():
        return
    scratch = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.creating")
    try:
        initialise(f"sqlite:///{scratch}")
        with contextlib.suppress(FileExistsError):  # another start finished first: keep theirs
            os.link(scratch, path)
    finally:
        scratch.unlink(missing_ok=True)


TEMPLATE_ENV = "HARNESS_STORE_TEMPLATES"  # a folder, or "0": build every store from scratch


def template_folder() -> Path | None:
    """Where empty stores are kept to be copied: ``$HARNESS_STORE_TEMPLATES``, else
    ``$XDG_CACHE_HOME/harness/stores`` (``~/.cache/harness/stores``); None when turned off."""
    chosen = os.environ.get(TEMPLATE_ENV, "").strip()
    if chosen == "0":
        return None
    if chosen:
        return Path(chosen)
    cache = os.environ.get("XDG_CACHE_HOME", "").strip() or Path.home() / ".cache"
    return Path(cache) / "harness" / "stores"


def build_mlflow_store(url: str) -> None:
    """MLflow's own way: open the store, which runs every schema migration (seconds)."""
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=url).search_experiments(max_results=1)


def initialise_mlflow_store(url: str) -> None:
    """Build the tables of a new SQLite MLflow store at ``url``.

    MLflow builds them by running its schema migrations one by one: about 3 s of CPU on a
    small machine, paid by every new store (each sweep into a fresh folder, each test). So an
    empty store is built that way once per MLflow version, kept in :func:`template_folder`,
    and copied; the copy's one row that depends on where it was made (MLflow's "Default"
    experiment, its artifact folder and dates) is then set as MLflow would have set it here.
    Where the cache cannot be written, the store is built from scratch as before.
    """
    import mlflow

    folder = template_folder()
    path = Path(url.removeprefix("sqlite:///"))
    if folder is None:
        build_mlflow_store(url)
        return
    template = folder / f"mlflow-{mlflow.__version__}-empty.db"
    try:
        prepare_store(f"sqlite:///{template}", build_mlflow_store)
        shutil.copyfile(template, path)
    except OSError:
        build_mlflow_store(url)
        return
    _place_default_experiment(path)


def _place_default_experiment(path: Path) -> None:
    """Give a copied store's "Default" experiment (id 0) the artifact folder and dates MLflow
    gives it when it creates a store from this working directory."""
    import sqlite3
    import time

    from mlflow.store.tracking import DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH
    from mlflow.utils.uri import append_to_uri_path, resolve_uri_if_local

    location = append_to_uri_path(resolve_uri_if_local(DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH), "0")
    now_ms = int(time.time() * 1000)
    with contextlib.closing(sqlite3.connect(path)) as database, database:
        database.execute(
            "UPDATE experiments SET artifact_location = ?, creation_time = ?,"
            " last_update_time = ? WHERE experiment_id = 0",
            (location, now_ms, now_ms),
        )


def storage_for(
    url: str,
    heartbeat_s: int | None = None,
    grace_s: int | None = None,
    on_stale: Callable[[Any, Any], None] | None = None,
) -> Any:
    """What Optuna is given for ``tracking.storage``: a URL, a journal-file storage, or, given
    ``heartbeat_s``, an ``RDBStorage`` that keeps Optuna's own heartbeat (``heartbeat_s``
    between beats, a trial without one for ``grace_s`` is stale, ``on_stale`` told of each)."""
    if url.startswith(JOURNAL_PREFIX):
        import optuna
        from optuna.storages.journal import JournalFileBackend

        path = Path(url.removeprefix(JOURNAL_PREFIX).removeprefix("//"))
        path.parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    if heartbeat_s is None or not is_database(url):
        return url
    import inspect
    import warnings

    import optuna

    # Optuna 4.9 renamed the callback's argument; both name the same thing.
    parameters = inspect.signature(optuna.storages.RDBStorage).parameters
    callback = (
        "heartbeat_stale_trial_callback"
        if "heartbeat_stale_trial_callback" in parameters
        else "failed_trial_callback"
    )
    stale: dict[str, Any] = {callback: on_stale}
    with warnings.catch_warnings():  # the heartbeat is "experimental" in every Optuna since 2.9
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(
            url, heartbeat_interval=heartbeat_s, grace_period=grace_s, **stale
        )


def is_database(url: str) -> bool:
    """Whether ``url`` is a SQLAlchemy database URL (an Optuna RDB storage)."""
    return urlparse(url).scheme.partition("+")[0] in ("sqlite", "postgresql", "mysql")


def shared_storage(url: str) -> str:
    """A storage several local processes may write: SQLite becomes a journal file beside it."""
    if url.startswith("sqlite:///"):
        return JOURNAL_PREFIX + str(Path(url.removeprefix("sqlite:///")).with_suffix(".journal"))
    return url


def redact(url: str) -> str:
    """The URL (or a text holding URLs: a spec file) without passwords, for printing and
    recording (``postgresql://me:***@host/db``)."""
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", url)
