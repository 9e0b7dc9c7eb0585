"""CPU affinity: each local worker gets cores of its own, inside a NUMA node, and says so."""

import os
import subprocess
import sys

import pytest

from kiln.core.affinity import cores_for, parse_cpulist


def test_cpulists_parse():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("") == set()


def test_slices_stay_inside_numa_nodes_and_never_overlap():
    nodes = [set(range(0, 6)), set(range(6, 12))]  # two nodes of 6 cores
    allowed = set(range(12))
    slices = [cores_for(r, 4, allowed, nodes) for r in range(3)]
    # 4 cores each: one whole slice per node first (cores 4-5 and 10-11 left for the third)
    assert slices[0] == [0, 1, 2, 3] and slices[1] == [6, 7, 8, 9]
    assert slices[2] == [4, 5, 10, 11]
    assert cores_for(3, 4, allowed, nodes) is None  # a fourth worker has no cores of its own
    assert cores_for(1, 2, {0, 1, 6, 7}, nodes) == [6, 7]  # only what the process may use


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs Linux and two allowed CPUs"
)
def test_a_worker_is_pinned_to_its_core_and_logs_it():
    mine = sorted(os.sched_getaffinity(0))
    code = (
        "import logging, os, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "from kiln.core.affinity import pin_worker\n"
        "import threading; t = threading.Thread(target=lambda: None); t.start(); t.join()\n"
        "print(sorted(pin_worker(1, 2, 1.0)), sorted(os.sched_getaffinity(0)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    *logs, result = out.strip().splitlines()
    pinned, now = result.split("] [")
    assert pinned.strip("[]") == now.strip("[]") and len(now.strip("[]").split(",")) == 1, out
    assert int(now.strip("[]")) in mine
    assert any("local rank 1 pinned to cores" in line for line in logs), out
    # too many workers for the cores: left alone, and said why
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        f"from kiln.core.affinity import pin_worker; print(pin_worker(0, {len(mine) + 1}, 1.0))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip().endswith("None") and "not pinned" in out, out
