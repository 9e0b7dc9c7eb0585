"""Start Ray nodes on this machine the way a user would (`ray start`), and stop exactly the
cluster a test started: never `ray stop --force`, which stops every Ray on the machine."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from kiln.launch.local import free_port

BIN = Path(sys.executable).parent
# The loopback S3 server's credentials (moto accepts any), for the tests and the Ray nodes.
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def wait_for_port(port: int, timeout: float = 60) -> None:
    """Until something listens on 127.0.0.1:`port`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def node_ports() -> dict[str, int]:
    """Free ports for the per-node daemons, so a second node (or someone else's Ray on the
    same machine) never collides with Ray's fixed defaults."""
    names = (
        "--node-manager-port",
        "--object-manager-port",
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
        "--metrics-export-port",
        "--runtime-env-agent-port",
    )
    return {name: free_port() for name in names}


def start_head(gcs_port: int, dash_port: int, env: dict, *args: str) -> None:
    """`ray start --head` with token auth (from `env`), its dashboard on loopback for jobs."""
    ports = {**node_ports(), "--ray-client-server-port": free_port()}
    out = subprocess.run(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            f"--port={gcs_port}",
            f"--dashboard-port={dash_port}",
            "--dashboard-host=127.0.0.1",
            "--disable-usage-stats",
            *(f"{k}={v}" for k, v in ports.items()),
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def ray_daemons(gcs_port: int) -> list[psutil.Process]:
    """The daemons of the Ray cluster whose GCS listens on `gcs_port`, on any node of this
    machine: each names the GCS in its command line (`--gcs_server_port=P`,
    `--gcs-address=host:P`, `--address=host:P`). They live as long as the cluster."""
    names = re.compile(rf"--(gcs_server_port=|gcs-address=\S+:|address=\S+:){gcs_port}(\s|$)")
    roots = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if names.search(" ".join(proc.info["cmdline"] or [])):
                roots.append(proc)
    return roots


def ray_cluster_processes(gcs_port: int) -> list[psutil.Process]:
    """Every process of that cluster: its daemons, and the workers and agents under them
    (workers come and go: Ray ends idle ones)."""
    found = {p.pid: p for root in ray_daemons(gcs_port) for p in process_tree(root)}
    return list(found.values())


def is_alive(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return proc.status() != psutil.STATUS_ZOMBIE
    return False


def process_tree(proc: psutil.Process) -> list[psutil.Process]:
    """`proc` and everything under it (only `proc` once it is gone)."""
    with contextlib.suppress(psutil.Error):
        return [proc, *proc.children(recursive=True)]
    return [proc]


def stop_ray_cluster(gcs_port: int, grace: float = 15) -> None:
    """Stop the cluster this session started, and nothing else. `ray stop --force` would stop
    every Ray on the machine, other people's included. Until none is left: a daemon may start
    a process (a worker, an agent) while it is being stopped, after the first look.

    The nodes' processes go first, then the monitors (the autoscaler's, the logs'), then the GCS:
    signalled all at once, the autoscaler's monitor outlived SIGTERM for the whole grace, every
    time (measured: 18.5 s a stop, against 5.5 s in this order)."""
    for _ in range(5):
        procs = [p for p in ray_cluster_processes(gcs_port) if is_alive(p)]
        if not procs:
            return
        gcs = [p for p in procs if runs_program(p, "gcs_server")]
        monitors = [p for p in procs if runs_program(p, "monitor.py")]  # log_monitor.py too
        for stage in ([p for p in procs if p not in gcs + monitors], monitors, gcs):
            _end(stage, grace)


def runs_program(proc: psutil.Process, program: str) -> bool:
    """Whether `proc` runs `program` (a path ending so, as the executable or the interpreter's
    script); False once it is gone."""
    with contextlib.suppress(psutil.Error):
        return any(a.endswith(program) for a in proc.cmdline()[:3])
    return False


def _end(procs: list[psutil.Process], grace: float) -> None:
    """SIGTERM, and SIGKILL what is left after `grace` seconds."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace)
