"""MLflow: where runs go, what is logged, and the small `log(metrics, step)` interface.

The driver creates the run (params, tags, artifacts) so it knows the run id before training;
rank 0 alone then logs per-step metrics into it, buffered and sent in batches. Secrets never
reach MLflow: params and tags pass through `redact`.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from kiln.errors import KilnError
from kiln.tracking.plots import PLOTTED, training_plots

log = logging.getLogger(__name__)

# "token" as in a credential, not the tokenizer or a count of tokens (data.tokenizer, data.train_tokens).
SECRET_PATTERN = re.compile(r"(secret|token(?!izer|s(?![a-z]))|password|passwd|credential|api[_-]?key|"
                            r"access[_-]?key|auth)", re.I)
REDACTED = "***"


def resolve_tracking_uri(configured: str = "") -> str:
    """Config, else $MLFLOW_TRACKING_URI, else a SQLite file in the cwd. Relative SQLite and
    file paths are made absolute so Ray workers, whose cwd differs, write to the same store."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI", "") or "sqlite:///mlflow.db"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + os.path.abspath(uri[len("sqlite:///") :])
    if "://" not in uri:
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


# user:password@ inside any URL (an S3 endpoint, a Postgres backend store, a tracking server)
URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]+:)[^/\s@]+@")


def redact(params: dict[str, Any]) -> dict[str, Any]:
    """Drop the value of any key that looks like a credential; scrub the rest (`scrub`)."""
    return {k: (REDACTED if SECRET_PATTERN.search(k) else scrub(v) if isinstance(v, str) else v)
            for k, v in params.items()}


def redact_tree(tree: Any) -> Any:
    """`redact` through nested dicts and lists: a config as a whole, before it becomes YAML."""
    if isinstance(tree, dict):
        return {k: (REDACTED if isinstance(k, str) and SECRET_PATTERN.search(k) else redact_tree(v))
                for k, v in tree.items()}
    if isinstance(tree, list):
        return [redact_tree(v) for v in tree]
    return scrub(tree) if isinstance(tree, str) else tree


def scrub(text: str) -> str:
    """Text with URL passwords masked and the value of every credential-named environment
    variable (AWS keys, MLflow and Ray tokens, ...) replaced by ***."""
    text = URL_PASSWORD.sub(lambda m: m.group("head") + REDACTED + "@", text)
    for value in _environment_secrets():
        text = text.replace(value, REDACTED)
    return text


def _environment_secrets() -> list[str]:
    # Short values ("1", "true", "token" as RAY_AUTH_MODE) are settings, not secrets.
    return sorted({v for k, v in os.environ.items() if SECRET_PATTERN.search(k) and len(v) >= 8},
                  key=len, reverse=True)


def configure_logging() -> None:
    """INFO to stderr for a command front end, with every line passed through `scrub`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(ScrubFilter())


class ScrubFilter(logging.Filter):
    """Masks secrets in log records on their way to a handler (see `scrub`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = scrub(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


def git_commit(path: str | os.PathLike = ".") -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def ui_command(uri: str) -> str:
    if uri.startswith(("http://", "https://")):
        return f"open {scrub(uri)}"
    return f"mlflow ui --backend-store-uri {scrub(uri)} --host 127.0.0.1 --port 5000"


class MetricLogger(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def set_tag(self, key: str, value: str) -> None: ...
    def log_artifacts(self, local_dir: str, artifact_path: str) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class NullLogger:
    """What every rank but 0 gets: only rank 0 logs."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def set_tag(self, key: str, value: str) -> None:
        pass

    def flush(self) -> None:
        pass

    def log_artifacts(self, local_dir: str, artifact_path: str) -> None:
        pass

    def close(self) -> None:
        pass


class MLflowLogger:
    """Per-step metrics into an existing MLflow run, buffered and sent with log_batch.

    One round trip per `flush_every` steps instead of one per metric, made by a background
    sender (kiln.tracking.sender) so that neither a slow nor a dead tracking server stalls a
    training step; what the server misses is delivered when it answers again.
    """

    def __init__(self, tracking_uri: str, run_id: str, flush_every: int = 20, flush_secs: float = 10.0,
                 system_metrics: bool = True, spill_dir: str = ".", outage_wait_s: float = 300.0):
        import mlflow
        from mlflow.tracking import MlflowClient

        from kiln.tracking.sender import Sender

        self._client = MlflowClient(tracking_uri)
        self._monitor = None
        if system_metrics:  # CPU, memory, disk, network (and GPU if pynvml is there) every 10 s
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            mlflow.set_tracking_uri(tracking_uri)
            self._monitor = SystemMetricsMonitor(run_id, sampling_interval=10)
            self._monitor.start()
        self._run_id = run_id
        self._sender = Sender(self._client, run_id, tracking_uri)
        self._spill_path = os.path.join(spill_dir, f"undelivered-metrics-{run_id}.jsonl")
        self._outage_wait_s = outage_wait_s
        self._flush_every, self._flush_secs = flush_every, flush_secs
        self._buffer: list = []
        self._last_flush = time.monotonic()
        self._steps = 0
        self._history: dict[str, list[tuple[int, float]]] = {}  # what the end-of-run plots need

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._buffer.extend(Metric(k, float(v), now, step) for k, v in metrics.items())
        for k in PLOTTED.intersection(metrics):
            self._history.setdefault(k, []).append((step, float(metrics[k])))
        self._steps += 1
        if self._steps % self._flush_every == 0 or time.monotonic() - self._last_flush > self._flush_secs:
            self._hand_over()

    def set_tag(self, key: str, value: str) -> None:
        from mlflow.entities import RunTag

        self._hand_over()  # keeps the order: the metrics logged before the tag go first
        self._sender.send_tags([RunTag(key, scrub(str(value))[:5000])])

    def _hand_over(self) -> None:
        # log_batch takes at most 1000 metrics per call.
        while self._buffer:
            chunk, self._buffer = self._buffer[:1000], self._buffer[1000:]
            self._sender.send_metrics(chunk)
        self._last_flush = time.monotonic()

    def flush(self, timeout: float = 30.0) -> None:
        """Deliver what is buffered before going on (a Tune scheduler may stop this run once it
        sees the next report). While the server is away this does not wait: the sender keeps it."""
        self._hand_over()
        if not self._sender.in_outage:
            self._sender.wait_idle(timeout)

    def log_artifacts(self, local_dir: str, artifact_path: str) -> None:
        self._sender.send_artifacts(local_dir, artifact_path)

    def close(self) -> None:
        self._hand_over()
        if self._history:
            with tempfile.TemporaryDirectory(prefix="kiln-plots-") as tmp:
                try:
                    if training_plots(self._history, tmp):
                        self.log_artifacts(tmp, "plots")
                except Exception as e:  # noqa: BLE001 - a plot must not fail a finished run
                    log.warning("end-of-run plots not logged: %s", scrub(str(e)))
            self._history = {}
        self._sender.close(self._outage_wait_s, self._spill_path)
        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None


class ArtifactLogger(NullLogger):
    """For a rank other than 0 that has files to hand in (a profile): artifacts, no metrics."""

    def __init__(self, tracking_uri: str, run_id: str):
        from mlflow.tracking import MlflowClient

        self._client, self._run_id = MlflowClient(tracking_uri), run_id

    def log_artifacts(self, local_dir: str, artifact_path: str) -> None:
        self._client.log_artifacts(self._run_id, local_dir, artifact_path)


class Run:
    """The driver's handle on one MLflow run."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str, parent_run_id: str | None = None,
                 tags: dict | None = None, run_id: str | None = None):
        """A new run, or (run_id given) a handle on an existing one. A child run (parent_run_id)
        nests under its parent in the MLflow UI."""
        import mlflow
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        mlflow.set_tracking_uri(tracking_uri)
        self.client = MlflowClient(tracking_uri)
        try:
            if run_id:
                self.run_id, exp_id = run_id, self.client.get_run(run_id).info.experiment_id
            else:
                exp_id = experiment_id(self.client, experiment)
                all_tags = {k: str(v) for k, v in redact(tags or {}).items()}
                if parent_run_id:
                    all_tags["mlflow.parentRunId"] = parent_run_id
                self.run_id = self.client.create_run(exp_id, run_name=run_name, tags=all_tags).info.run_id
        except Exception as e:  # the store's own errors are many and unhelpful
            raise KilnError(f"cannot create an MLflow run at {tracking_uri}: {e}") from None
        self.experiment_id = exp_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in redact(params).items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def set_tags(self, tags: dict[str, Any]) -> None:
        for k, v in redact(tags).items():
            self.client.set_tag(self.run_id, k, str(v))

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, scrub(text), artifact_file)

    def log_file(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def finish(self, ok: bool, status: str | None = None) -> None:
        self.client.set_terminated(self.run_id, status or ("FINISHED" if ok else "FAILED"))


def experiment_id(client, name: str) -> str:
    """The id of experiment `name`, created if missing (and safe against a concurrent create)."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:
        exp = client.get_experiment_by_name(name)  # another trial created it first
        if exp is None:
            raise
        return exp.experiment_id
