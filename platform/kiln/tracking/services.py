"""`kiln services up|down|status`: the shared services a small team needs, on one machine.

- An MLflow tracking server: runs in SQLite under the services dir (or any backend store URI,
  e.g. postgresql://...), artifacts served through the server (`--serve-artifacts`) from a local
  folder or an s3:// destination, so clients never need the store's credentials.
- Optionally Prometheus, scraping Ray's metrics through the service-discovery file every Ray
  head writes.

Both bind to 127.0.0.1 unless `--host` says otherwise: a tracking server holds every run's
params and artifacts, and neither has authentication of its own. The processes run detached, in
their own sessions; their pids, addresses and logs are recorded in `<dir>/services.json`
(written to a temp file, then renamed), which `down` and `status` read.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from kiln import guard
from kiln.errors import KilnError
from kiln.schemas import validated
from kiln.storage import write_private
from kiln.tracking.server import SERVER_EXTRA, server_missing

log = logging.getLogger("kiln.tracking.services")
STATE = "services.json"
SERVICES = "services"  # the write guard's kind for a services directory
# Ray's head writes the addresses of every node's metrics agent here (Ray's Prometheus docs).
RAY_SD_FILE = "/tmp/ray/prom_metrics_service_discovery.json"


@dataclass
class Service:
    name: str
    pid: int
    url: str
    log: str
    started: float = 0.0
    """The process's start time (psutil's create_time): with the pid, what makes it the process
    Kiln started. A pid alone is reused after the server exits or the machine reboots."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of this process still answers kill(0): reap it if it is ours.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def _started(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _running(s: Service) -> bool:
    """Whether the process Kiln recorded is still running: the pid alive and started when the
    record says. Anything else under that pid is not Kiln's, and is never signalled."""
    return _alive(s.pid) and _started(s.pid) == s.started


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _wait_http(url: str, proc: subprocess.Popen, timeout: float, log_path: Path) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGTERM) if proc.poll() is None else None
    tail = log_path.read_text(errors="replace").strip().splitlines()[-5:] if log_path.exists() else []
    raise KilnError(
        f"{url} did not come up within {timeout:.0f} s; the last lines of {log_path}:\n  " + "\n  ".join(tail)
    )


def _load(root: Path) -> list[Service]:
    path = root / STATE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    return validated(
        list[Service],
        raw,
        f"{path} is not a services state file (remove it and stop the processes by hand)",
        json=True,
        error=KilnError,
    )


def _check_dir(root: Path) -> None:
    """`--dir` is new, empty, or a services directory Kiln made (its marker says so; one made
    before the marker gets it with `echo kiln-output:services > DIR/.kiln-output`)."""
    guard.check_dir_target(root, SERVICES, f"--dir {root}", replace=True, error=KilnError, make_parents=True)


def _check_backend(uri: str) -> None:
    """MLflow creates its tables in any database it is given: refuse one that holds another
    application's tables."""
    from kiln.tracking.server import check_sqlite_store

    if uri.startswith("sqlite:///"):
        check_sqlite_store(os.path.abspath(uri[len("sqlite:///") :]), "--backend-store-uri")


def _save(root: Path, services: list[Service]) -> None:
    write_private(root / STATE, json.dumps([asdict(s) for s in services], indent=2))


def _spawn(cmd: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as out:
        # Own session: Ctrl-C in this terminal does not reach it, and `down` stops its whole group.
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )


def up(
    root: str | Path = "runs/services",
    host: str = "127.0.0.1",
    port: int = 5000,
    backend_store_uri: str | None = None,
    artifacts_destination: str | None = None,
    prometheus: bool = False,
    prometheus_port: int = 9090,
    timeout: float = 120.0,
) -> list[Service]:
    root = guard.local_path(root)
    _check_dir(root)
    backend = backend_store_uri or f"sqlite:///{root / 'mlflow.db'}"
    _check_backend(backend)  # what the user gave, before what the machine has (ports, binaries)
    running = [s for s in _load(root) if _running(s)]
    if running:
        raise KilnError(
            f"services already running from {root}: "
            + ", ".join(f"{s.name} at {s.url} (pid {s.pid})" for s in running)
            + "; `kiln services down` first"
        )
    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding to %s: anyone who can reach this address can read and write every run", host)
    for name, p in (("MLflow", port),) + ((("Prometheus", prometheus_port),) if prometheus else ()):
        if not _port_free(host, p):
            raise KilnError(
                f"port {p} on {host} is in use; pick another for {name} with "
                f"--{'port' if name == 'MLflow' else 'prometheus-port'}"
            )
    missing = server_missing()
    if missing:
        raise KilnError(f"MLflow's server needs {missing}, which this environment lacks: {SERVER_EXTRA}")
    prom_bin = shutil.which("prometheus") if prometheus else None
    if prometheus and not prom_bin:
        raise KilnError(
            "--prometheus: no `prometheus` binary on PATH; install Debian's package "
            "(apt-get install prometheus) or leave --prometheus off"
        )

    root.mkdir(parents=True, exist_ok=True)  # only once every check has passed
    guard.mark(root, SERVICES)
    started: list[Service] = []
    try:
        artifacts = artifacts_destination or str(root / "artifacts")
        mlflow_log = root / "mlflow.log"
        cmd = [
            str(Path(sys.executable).parent / "mlflow"),
            "server",
            "--host",
            host,
            "--port",
            str(port),
            "--backend-store-uri",
            backend,
            "--serve-artifacts",
            "--artifacts-destination",
            artifacts,
            "--workers",
            "2",
        ]
        proc = _spawn(cmd, mlflow_log)
        url = f"http://{host}:{port}"
        started.append(Service("mlflow", proc.pid, url, str(mlflow_log), _started(proc.pid) or 0.0))
        _wait_http(f"{url}/health", proc, timeout, mlflow_log)
        if prom_bin:
            started.append(_start_prometheus(prom_bin, root, host, prometheus_port, timeout))
    except BaseException:
        _stop(started)
        raise
    _save(root, started)
    return started


def _start_prometheus(binary: str, root: Path, host: str, port: int, timeout: float) -> Service:
    """Prometheus scraping Ray's service discovery file, with Kiln's alert rules in a checkout."""
    cfg = root / "prometheus.yml"
    alerts = Path(__file__).resolve().parents[2] / "dashboards" / "alerts.yml"  # in a checkout
    cfg.write_text(
        "global: {scrape_interval: 5s, evaluation_interval: 15s}\n"
        + (f"rule_files: ['{alerts}']\n" if alerts.is_file() else "")
        + "scrape_configs:\n"
        "  - job_name: ray\n"
        f"    file_sd_configs: [{{files: ['{RAY_SD_FILE}']}}]\n"
    )
    prom_log = root / "prometheus.log"
    proc = _spawn(
        [
            binary,
            f"--config.file={cfg}",
            f"--storage.tsdb.path={root / 'prometheus-data'}",
            f"--web.listen-address={host}:{port}",
        ],
        prom_log,
    )
    service = Service("prometheus", proc.pid, f"http://{host}:{port}", str(prom_log), _started(proc.pid) or 0.0)
    try:
        _wait_http(f"{service.url}/-/ready", proc, timeout, prom_log)
    except BaseException:
        _stop([service])
        raise
    return service


def _stop(services: list[Service], timeout: float = 30.0) -> None:
    gone = [s for s in services if not _running(s)]
    for s in gone:
        if _alive(s.pid):
            log.warning(
                "pid %d is no longer the %s Kiln started (another process has that pid now); left alone", s.pid, s.name
            )
    services = [s for s in services if s not in gone]
    for s in services:
        try:
            os.killpg(s.pid, signal.SIGTERM)  # the server and its gunicorn/uvicorn workers
        except ProcessLookupError:
            continue
    deadline = time.time() + timeout
    for s in services:
        while _alive(s.pid) and time.time() < deadline:
            time.sleep(0.2)
        if _alive(s.pid):
            os.killpg(s.pid, signal.SIGKILL)


def down(root: str | Path = "runs/services") -> list[Service]:
    root = guard.local_path(root)
    services = _load(root)
    _stop(services)
    if guard.owns_dir(root, SERVICES):
        guard.remove_file(root / STATE, proof="the services record of a directory Kiln marked as its services'")
    elif services:
        log.warning("%s has no %s marker, so its %s is left in place", root, guard.MARKER, STATE)
    return services


def status(root: str | Path = "runs/services") -> list[tuple[Service, bool]]:
    return [(s, _running(s)) for s in _load(guard.local_path(root))]
