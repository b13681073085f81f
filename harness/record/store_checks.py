"""Is a store usable? One line saying what is wrong with it, before anything opens it.

MLflow and Optuna meet a broken store with a long traceback, and sometimes only after minutes:
MLflow retries an unreachable server for ~4 minutes and a refused database connection ten
times. A command that reads a store that is not there must not create it, and a check must not
"repair" a damaged file (SQLite rolls back a hot journal when it may write). So every store a
command opens is first looked at here, read-only and with short timeouts, and each function
answers with the problem in words, or None. ``harness.sweep.preflight`` puts the spec field in
front of the answer; the read commands go through ``require_tracking_store``.

What is checked: an MLflow tracking store (``sqlite:///``, ``file://`` or a plain path,
``http(s)://``, a SQLAlchemy database URL) and an Optuna storage (SQLite, ``journal:PATH``, a
database URL). A SQLite file is cut short when it is smaller than its header says (the cheap
test), damaged when SQLite's own read-only check says so, and not the store asked for when it
lacks that store's tables. A damage found only later escapes as a database error:
``escaped_store_error`` turns it into one line naming the store.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from urllib.parse import urlparse

from harness.record.stores import JOURNAL_PREFIX, redact

# Connecting to a server, a /health answer, a database's connect_timeout, a busy SQLite file.
# Long enough for a store on a loaded machine (a server busy with a sweep beside this one) to
# answer; a refused connection or a missing host answers at once whatever it is. A store that
# says nothing within it is reported as such, naming this limit.
TIMEOUT_S = 15
# SQLite's quick_check reads every page: on files up to this size it costs well under a second.
# Larger files get the header and schema tests; their damage shows later as a database error.
QUICK_CHECK_MAX_BYTES = 64 * 2**20
SQLITE_MAGIC = b"SQLite format 3\x00"
SQLITE_HEADER_BYTES = 100
# sqlite3 primary result codes that say "the file is fine, someone else holds it": not a problem.
SQLITE_BUSY, SQLITE_LOCKED, SQLITE_READONLY = 5, 6, 8
MLFLOW_TABLES = frozenset({"experiments", "runs"})
OPTUNA_TABLES = frozenset({"studies"})
DATABASE_SCHEMES = ("postgresql", "mysql")  # whose drivers take connect_timeout
# Read commands retry an MLflow server briefly: MLflow's defaults (7 retries, backoff factor 2,
# 120 s per request) make an unreachable server a four-minute wait. A user's own values win.
READ_HTTP_SETTINGS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}
MLFLOW_DAMAGED = (
    "restore it from a backup (`sqlite3 FILE .recover | sqlite3 NEW.db` may save what is left "
    "of a damaged one)"
)
OPTUNA_DAMAGED = (
    "the sweep's trials are also recorded in MLflow: move the file aside and run the sweep again"
)
MAX_CAUSE = 240  # characters of a library's message kept in the one line


class StoreError(Exception):
    """A store that cannot be used: ``label`` (the option or field naming it), ``store`` (its
    URI, password hidden) and ``why``, said in one line."""

    def __init__(self, store: str, why: str, label: str = "tracking_uri") -> None:
        self.store, self.why, self.label = redact(store), why, label
        super().__init__(self.line())

    def line(self, label: str | None = None) -> str:
        return f"{label or self.label}: cannot use {self.store}: {self.why}"


def first_line(cause: object) -> str:
    """A library's message as one line: its first line, clipped; the type when it has none."""
    text = str(cause).strip()
    line = text.splitlines()[0].strip() if text else type(cause).__name__
    return line if len(line) <= MAX_CAUSE else line[: MAX_CAUSE - 1] + "…"


def scheme_of(url: str) -> str:
    """``postgresql`` for ``postgresql+psycopg://...``; ``""`` for a plain path."""
    scheme = urlparse(url).scheme.partition("+")[0]
    return "" if len(scheme) == 1 else scheme  # C:\\ on Windows is a path, not a scheme


def sqlite_file(url: str) -> Path | None:
    """The file of a ``sqlite:///PATH`` URL; None for an in-memory database."""
    raw = url.partition(":///")[2].partition("?")[0] if ":///" in url else ""
    return None if raw in ("", ":memory:") else Path(raw)


def journal_file(url: str) -> Path:
    return Path(url.removeprefix(JOURNAL_PREFIX).removeprefix("//"))


# ---- each kind of store -----------------------------------------------------------------------


def timed_out(what: str) -> str:
    """The answer for a store silent past ``TIMEOUT_S``: which limit was hit, not "timed out"."""
    return f"{what} within the {TIMEOUT_S:g} s limit of the store check"


def http_problem(uri: str) -> str | None:
    """Why the MLflow server at ``uri`` does not answer on ``/health`` (in ``TIMEOUT_S``)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=TIMEOUT_S) as answer:
            if answer.status >= 400:
                return f"HTTP {answer.status} from /health"
    except urllib.error.HTTPError as error:
        return f"HTTP {error.code} from /health"
    except OSError as error:  # URLError, timeouts, refused connections
        cause = getattr(error, "reason", error)
        if isinstance(cause, TimeoutError):  # connecting (in a URLError) or reading
            return timed_out("no answer on /health")
        return first_line(cause)
    return None


def database_problem(url: str, tables: frozenset[str] = frozenset(), what: str = "") -> str | None:
    """Why the database at ``url`` refuses a connection (in ``TIMEOUT_S``); given ``tables``,
    also when it lacks them (a read must find ``what`` there, never create it)."""
    try:
        import sqlalchemy as sa
        from sqlalchemy.exc import SQLAlchemyError
    except ImportError as error:
        return first_line(error)
    try:
        engine = sa.create_engine(url, connect_args={"connect_timeout": TIMEOUT_S})
    except (SQLAlchemyError, ImportError) as error:  # an unknown dialect, a missing driver
        return first_line(error)
    try:
        with engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
            found = set(sa.inspect(connection).get_table_names()) if tables else set()
    except SQLAlchemyError as error:
        cause = first_line(getattr(error, "orig", None) or error)
        if "timeout" in cause.lower() or "timed out" in cause.lower():  # connect_timeout
            return f"{cause} ({timed_out('no connection')})"
        return cause
    except ImportError as error:
        return first_line(error)
    finally:
        engine.dispose()
    if tables and not tables <= found:
        missing = " or ".join(sorted(tables - found))
        return f"the database holds no {what} (it has no {missing} table)"
    return None


def sqlite_header_size(header: bytes) -> int | None:
    """The database size in bytes that a SQLite file's header records, or None where the
    header keeps none (a file written by SQLite before 3.7.0 leaves it stale)."""
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    valid = header[24:28] == header[92:96]  # the change counter the size was last written at
    return page_size * pages if valid and pages else None


def sqlite_read(path: Path, quick_check: bool) -> tuple[set[str], str]:
    """The file's tables and SQLite's ``quick_check`` verdict (``ok`` unless it found damage;
    also ``ok`` when not asked), read through a read-only connection that never creates,
    writes or rolls back the file."""
    import sqlite3

    connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=TIMEOUT_S)
    try:
        rows = connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        tables = {name for (name,) in rows}
        verdict = "ok"
        if quick_check:
            found = [str(row[0]) for row in connection.execute("PRAGMA quick_check(3)")]
            verdict = "; ".join(found) or "ok"
        return tables, verdict
    finally:
        connection.close()


def sqlite_problem(
    url: str,
    tables: frozenset[str],
    what: str,
    damaged: str,
    reading: bool,
    thorough: bool = False,
) -> str | None:
    """Why the SQLite file of ``url`` (``sqlite:///PATH``) cannot serve as ``what`` (whose
    ``tables`` it must hold once it has any): not SQLite, cut short, damaged (``damaged`` says
    what to do), or another program's database. A missing or empty file is a new store, unless
    ``reading``; an in-memory database has no file to check. ``thorough``: SQLite's
    quick_check whatever the file's size. Both stores a sweep has are checked here."""
    import sqlite3

    path = sqlite_file(url)
    if path is None:
        return None
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            header = file.read(SQLITE_HEADER_BYTES)
    except FileNotFoundError:
        return f"{path} does not exist" if reading else None
    except OSError as error:
        return f"{path}: {error.strerror or error}"
    if size == 0:
        return f"{path} is an empty file, not {what}" if reading else None
    if len(header) < SQLITE_HEADER_BYTES or not header.startswith(SQLITE_MAGIC):
        return f"{path} is not a SQLite database ({size:,} bytes, no SQLite header): {damaged}"
    expected = sqlite_header_size(header)
    short = expected is not None and size < expected
    try:
        quick = thorough or short or size <= QUICK_CHECK_MAX_BYTES
        found, verdict = sqlite_read(path, quick_check=quick)
    except sqlite3.Error as error:
        code = getattr(error, "sqlite_errorcode", 0) & 0xFF
        if code in (SQLITE_BUSY, SQLITE_LOCKED, SQLITE_READONLY):
            return None  # in use by a writer, or needs one: the real open decides
        verdict = first_line(error)
    if verdict != "ok":
        cut = f", {size:,} of the {expected:,} bytes its header records" if short else ""
        return f"the SQLite file {path} is damaged ({first_line(verdict)}{cut}): {damaged}"
    if found and not tables <= found:
        listed = ", ".join(sorted(found)[:5]) + (", …" if len(found) > 5 else "")
        return f"{path} is a SQLite database but not {what} (its tables: {listed})"
    if reading and not found:
        return f"{path} holds no tables, not {what}"
    return None


def journal_problem(path: Path) -> str | None:
    """Why ``path`` is not a usable Optuna journal: each line must be a JSON record with an
    ``op_code``. A torn last line (a write cut short, a truncated copy) is a problem too:
    Optuna skips it when reading but appends its next record right after it, and the merged
    line then breaks every later read. Missing or empty: a new journal."""
    try:
        file = path.open("rb")
    except FileNotFoundError:
        return None
    except OSError as error:
        return f"{path}: {error.strerror or error}"
    with file:
        for number, line in enumerate(file, start=1):
            if not line.endswith(b"\n"):
                return (
                    f"{path} ends in a record cut short (line {number}); Optuna would write "
                    f"after it and damage the journal: {OPTUNA_DAMAGED}"
                )
            try:
                record = json.loads(line)
            except ValueError:  # not UTF-8, not JSON
                return (
                    f"{path} is not an Optuna journal (line {number} is not JSON): {OPTUNA_DAMAGED}"
                )
            if not isinstance(record, dict) or "op_code" not in record:
                return (
                    f"{path} is not an Optuna journal (line {number} is not one of its records): "
                    f"{OPTUNA_DAMAGED}"
                )
    return None


def file_store_problem(path: Path, reading: bool) -> str | None:
    """Why MLflow cannot use the folder ``path`` as a file store (MLflow 3 refuses file stores
    unless ``MLFLOW_ALLOW_FILE_STORE`` is set)."""
    if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() not in ("true", "1"):
        return (
            "MLflow 3 refuses file stores (maintenance mode): use sqlite:///PATH.db "
            "(`mlflow migrate-filestore` converts this one), or set MLFLOW_ALLOW_FILE_STORE=true"
        )
    if path.exists() and not path.is_dir():
        return f"{path} is a file, not an MLflow file store (a folder)"
    if reading and not path.exists():
        return f"{path} does not exist"
    return None


# ---- the two stores a sweep has ---------------------------------------------------------------


def tracking_problem(uri: str, reading: bool = False, thorough: bool = False) -> str | None:
    """What is wrong with the MLflow tracking store ``uri``, or None. ``reading``: the command
    only reads, so the store must already be one (nothing is created for it). ``thorough``:
    a SQLite file is checked page by page whatever its size."""
    scheme = scheme_of(uri)
    if scheme == "sqlite":
        what = "an MLflow store"
        return sqlite_problem(uri, MLFLOW_TABLES, what, MLFLOW_DAMAGED, reading, thorough)
    if scheme in ("http", "https"):
        return http_problem(uri)
    if scheme in DATABASE_SCHEMES:
        return database_problem(uri, MLFLOW_TABLES if reading else frozenset(), "MLflow store")
    if scheme in ("", "file"):
        return file_store_problem(Path(urlparse(uri).path if scheme else uri), reading)
    return None  # databricks, uc, ...: MLflow's own business


def storage_problem(url: str, thorough: bool = False) -> str | None:
    """What is wrong with the Optuna storage ``url``, or None (a missing file is a new study).
    ``thorough``: a SQLite file is checked page by page whatever its size."""
    if url.startswith(JOURNAL_PREFIX):
        return journal_problem(journal_file(url))
    scheme = scheme_of(url)
    if scheme == "sqlite":
        what = "an Optuna storage"
        return sqlite_problem(url, OPTUNA_TABLES, what, OPTUNA_DAMAGED, False, thorough)
    if scheme in DATABASE_SCHEMES:
        return database_problem(url)
    return None


# ---- what the commands call -------------------------------------------------------------------

# Every store checked in this process: its URI -> (label, "mlflow" or "optuna"), so an error
# that still escapes is said naming the store (``escaped_store_error``).
OPENED: dict[str, tuple[str, str]] = {}
_USABLE: set[str] = set()  # tracking URIs found usable: a command opens its store many times


def note_store(label: str, store: str, kind: str) -> None:
    """Remember ``store`` under ``label`` (the first label given wins: a spec field)."""
    OPENED.setdefault(store, (label, kind))


def require_tracking_store(uri: str, label: str = "tracking_uri") -> None:
    """For a command that reads MLflow: ``StoreError`` unless ``uri`` is an MLflow store now
    (checked once per process). An MLflow server is then retried briefly, not for minutes."""
    note_store(label, uri, "mlflow")
    if uri in _USABLE:
        return
    if scheme_of(uri) in ("http", "https"):
        for name, value in READ_HTTP_SETTINGS.items():
            os.environ.setdefault(name, value)
    why = tracking_problem(uri, reading=True)
    if why:
        raise StoreError(uri, why, label)
    _USABLE.add(uri)


# Errors of a store that may escape from MLflow, Optuna or SQLAlchemy once it broke after its
# check (MLflow wraps them in an MlflowException), by module: looked up among the modules
# already imported (an error cannot be of a type never loaded), so naming them imports nothing.
STORE_ERRORS = (
    ("sqlite3", "Error"),
    ("sqlalchemy.exc", "SQLAlchemyError"),
    ("optuna.exceptions", "StorageInternalError"),
    ("requests.exceptions", "ConnectionError"),
    ("requests.exceptions", "Timeout"),
)


def store_error_in(error: BaseException | None) -> BaseException | None:
    """The store's error in ``error`` or in what it was raised from, or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        for module, name in STORE_ERRORS:
            kind = getattr(sys.modules.get(module), name, None)
            if isinstance(kind, type) and isinstance(error, kind):
                return error
        hidden = error.__suppress_context__  # raise ... from None: handled there
        error = error.__cause__ or (None if hidden else error.__context__)
    return None


def recheck(store: str, kind: str) -> str | None:
    """The store's problem, looked at again in full (SQLite's quick_check whatever the size)."""
    try:
        if kind == "mlflow":
            return tracking_problem(store, thorough=True)
        return storage_problem(store, thorough=True)
    except Exception:  # a check must never hide the error it explains
        return None


def escaped_store_error(error: BaseException, labels: dict[str, str] | None = None) -> str | None:
    """One line for a store's error that got past the checks (a ``StoreError``, or a database
    error from MLflow, Optuna, SQLAlchemy or sqlite3), or None for any other error. The line
    names the store: the one that now fails its check, else the only one opened, else all.
    ``labels`` renames labels (``tracking_uri`` -> ``--tracking-uri`` on a command line)."""
    labels = labels or {}
    if isinstance(error, StoreError):
        return error.line(labels.get(error.label))
    found = store_error_in(error)
    if found is None:
        return None
    cause = first_line(getattr(found, "orig", None) or found)
    for store, (label, kind) in OPENED.items():
        why = recheck(store, kind)
        if why:
            return StoreError(store, why, labels.get(label, label)).line()
    if len(OPENED) == 1:
        ((store, (label, _)),) = OPENED.items()
        return StoreError(store, cause, labels.get(label, label)).line()
    named = "; ".join(
        f"{labels.get(label, label)} {redact(store)}" for store, (label, _) in OPENED.items()
    )
    return f"harness: a store failed{f' (one of {named})' if named else ''}: {cause}"
