"""The session's clean-up stops only the Ray cluster it started: a second cluster on the same
machine (another user's, here started by the test) keeps running, and the stopped one is gone
to its last worker."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import psutil

from kiln.launch.local import free_port

sys.path.insert(0, str(Path(__file__).parent))
from ray_nodes import ray_cluster_processes, start_head, stop_ray_cluster  # noqa: E402


def _names(procs: list[psutil.Process]) -> set[str]:
    return {" ".join(p.cmdline()[:2]) for p in procs if p.is_running()}


def test_stopping_a_cluster_leaves_another_running(ray_cluster):
    gcs, _, env = ray_cluster
    session_port = int(gcs.rsplit(":", 1)[1])
    session = ray_cluster_processes(session_port)
    assert any("gcs_server" in n for n in _names(session)) and any("raylet" in n for n in _names(session))

    other_port = free_port()
    # Its own temp dir: a second head in /tmp/ray would rewrite the session's Prometheus
    # service-discovery file.
    with tempfile.TemporaryDirectory(prefix="kr-", dir="/tmp") as temp_dir:
        start_head(other_port, free_port(), env, "--num-cpus=1", f"--temp-dir={temp_dir}")
        other = ray_cluster_processes(other_port)
        assert not {p.pid for p in other} & {p.pid for p in session}
        assert any("raylet" in n for n in _names(other)) and any("gcs_server" in n for n in _names(other))

        stop_ray_cluster(other_port)

    assert not [p for p in other if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert ray_cluster_processes(other_port) == []
    assert all(p.is_running() for p in session), "stopping another cluster touched the session's"
