"""Where runs go: the tracking URI, whether its server answers, and how to open its UI."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

from kiln.errors import KilnError
from kiln.storage import is_url
from kiln.tracking.redact import scrub


def resolve_tracking_uri(configured: str = "") -> str:
    """Config, else $MLFLOW_TRACKING_URI, else a SQLite file in the cwd. Relative SQLite and
    file paths are made absolute so Ray workers, whose cwd differs, write to the same store."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI", "") or "sqlite:///mlflow.db"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + os.path.abspath(uri[len("sqlite:///") :])
    if not is_url(uri):
        return "file://" + os.path.abspath(uri)
    return uri


def server_address(uri: str) -> tuple[str, int] | None:
    """(host, port) of an HTTP(S) tracking server; None for a local store (sqlite, file)."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https"):
        return None
    return parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)


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


def ui_command(uri: str) -> str:
    if uri.startswith(("http://", "https://")):
        return f"open {scrub(uri)}"
    return f"mlflow ui --backend-store-uri {scrub(uri)} --host 127.0.0.1 --port 5000"
