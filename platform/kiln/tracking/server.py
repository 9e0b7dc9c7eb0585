"""Where runs go: the tracking URI, whether its server answers, and how to open its UI."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
from urllib.parse import urlparse

from kiln.errors import ConfigError, KilnError
from kiln.redact import scrub
from kiln.storage import durable, is_url, without_userinfo


def resolve_tracking_uri(configured: str = "") -> str:
    """Config, else $MLFLOW_TRACKING_URI, else a SQLite file in the cwd. Relative SQLite and
    file paths are made absolute so Ray workers, whose cwd differs, write to the same store."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI", "") or "sqlite:///mlflow.db"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + os.path.abspath(
            durable(uri[len("sqlite:///") :], "logging.tracking_uri", "MLFLOW_TRACKING_URI")
        )
    if not is_url(uri):
        return "file://" + os.path.abspath(durable(uri, "logging.tracking_uri", "MLFLOW_TRACKING_URI"))
    return uri


def server_address(uri: str) -> tuple[str | None, int] | None:
    """(host, port) of an HTTP(S) tracking server; None for a local store (sqlite, file)."""
    parsed = urlparse(without_userinfo(uri))  # a password holding '#' or '?' misleads urllib
    if parsed.scheme not in ("http", "https"):
        return None
    try:
        port = parsed.port
    except ValueError:
        raise ConfigError(f"{scrub(uri)}: the port is not a number") from None
    return parsed.hostname, port or (443 if parsed.scheme == "https" else 80)


# The schemes MLflow 3 has tracking stores for (a database's may name its driver:
# postgresql+psycopg2://); anything else fails inside MLflow, after the run has started.
STORE_SCHEMES = ("file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks", "databricks-uc", "uc")
SQLITE_HEADER = b"SQLite format 3\x00"


def check_store(uri: str, name: str = "logging.tracking_uri", read_only: bool = False) -> None:
    """Before any work: MLflow has a store for the URI's scheme, a database's driver is
    installed, an SQLite file is an MLflow store (never another application's database, which
    MLflow would fill with its tables), and a server answers. `read_only`: the command only
    reads, so a store that is not there is an error, not a new file. `name` is the field or
    flag that gave the URI, for the error."""
    scheme = urlparse(uri).scheme.partition("+")[0]
    if scheme not in STORE_SCHEMES:
        raise ConfigError(
            f"{name} = {scrub(uri)!r}: MLflow has no store for {scheme + '://'!r}; expected "
            "sqlite:///path, file:///path, http(s)://host:port or a database URL"
        )
    if scheme in ("postgresql", "mysql", "mssql"):
        import sqlalchemy

        try:
            sqlalchemy.engine.make_url(uri).get_dialect().import_dbapi()
        except ImportError as e:
            raise KilnError(
                f"{name} = {scrub(uri)!r} needs the database driver {e.name!r}, which is not "
                f"installed here (pip install {e.name})"
            ) from None
    if scheme == "sqlite":
        check_sqlite_store(uri[len("sqlite:///") :], name, read_only)
    elif scheme == "file" and read_only and not os.path.isdir(urlparse(uri).path):
        raise KilnError(
            f"no MLflow store at {scrub(uri)}: nothing has been logged here yet; pass {name} "
            "or set $MLFLOW_TRACKING_URI to where your runs are"
        )
    check_reachable(uri)


# Tables every MLflow SQLite store has (its schema is versioned by alembic); a database with
# tables and without these is another application's.
MLFLOW_TABLES = {"alembic_version", "experiments", "runs"}


def check_sqlite_store(path: str, name: str, read_only: bool = False) -> None:
    """An SQLite path MLflow may open: an MLflow store, or (unless `read_only`) nothing yet or
    an empty file. Read with SQLite's read-only mode, so the check itself changes nothing."""
    import sqlite3

    size = os.path.getsize(path) if os.path.isfile(path) else None
    if not size:
        if read_only:
            raise KilnError(
                f"no MLflow store at sqlite:///{path}: nothing has been logged here yet; pass "
                f"{name} or set $MLFLOW_TRACKING_URI to where your runs are"
            )
        if os.path.exists(path) and not os.path.isfile(path):
            raise KilnError(f"{name}: {path} is not a file, so not an MLflow store")
        return
    with open(path, "rb") as f:
        if f.read(len(SQLITE_HEADER)) != SQLITE_HEADER:
            raise KilnError(f"{name}: {path} is not an SQLite database, so not an MLflow store")
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error as e:
        raise KilnError(f"{name}: {path} cannot be read as an SQLite database ({e})") from None
    if tables and not tables >= MLFLOW_TABLES:
        raise KilnError(
            f"{name}: {path} is another application's SQLite database (tables: "
            f"{', '.join(sorted(tables)[:5])}), not an MLflow store; Kiln never writes into it"
        )
    if not tables and read_only:
        raise KilnError(f"no MLflow store at sqlite:///{path}: the database is empty")


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    """Fail fast with a clear message if an HTTP tracking server does not answer."""
    address = server_address(uri)
    if address is None:
        return
    try:
        with socket.create_connection(address, timeout=timeout):
            pass
    except OSError as e:
        raise KilnError(
            f"MLflow tracking server {scrub(uri)} is unreachable ({e.strerror or e}); start it, or set "
            "logging.tracking_uri / $MLFLOW_TRACKING_URI to a reachable server or sqlite:///mlflow.db"
        ) from None


SERVER_EXTRA = "pip install 'kiln[server]'"  # MLflow's server and UI (pyproject's `server` extra)


def server_missing() -> str | None:
    """The module MLflow's server and UI import first (flask) if this environment lacks it, or
    None. Kiln depends on mlflow-skinny, which has neither; the `server` extra adds them. Looked
    up, not imported: the summary asks at the end of every run."""
    return "flask" if importlib.util.find_spec("flask") is None else None


def ui_command(uri: str) -> str:
    if uri.startswith(("http://", "https://")):
        return f"open {scrub(uri)}"
    command = f"mlflow ui --backend-store-uri {scrub(uri)} --host 127.0.0.1 --port 5000"
    return command if server_missing() is None else f"{command}  (after {SERVER_EXTRA})"
