"""Each CPU worker's threads on cores of its own, inside one NUMA node where the host has several.

Two workers on one host that float over all its cores evict each other's caches and fight over
cores (torch's intra-op pool spins), so each worker is pinned to `cores_per_worker` cores of its
own. Its slice is taken from this process's allowed CPUs (what Ray, a container or taskset
allow), NUMA node by node, so a worker's cores share a memory controller. Stdlib only: Linux's
sched_setaffinity and sysfs; elsewhere it does nothing.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os

log = logging.getLogger("kiln.train")


def numa_nodes() -> list[set[int]]:
    """The host's NUMA nodes as sets of CPU ids (one node holding all CPUs where sysfs says none)."""
    nodes = []
    for path in sorted(glob.glob("/sys/devices/system/node/node[0-9]*/cpulist")):
        with open(path) as f:
            nodes.append(parse_cpulist(f.read()))
    return [n for n in nodes if n] or [set(range(os.cpu_count() or 1))]


def parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def cores_for(local_rank: int, cores_per_worker: int, allowed: set[int], nodes: list[set[int]]) -> list[int] | None:
    """The cores of worker `local_rank`: consecutive slices of the allowed CPUs ordered node by
    node, a slice never split over two nodes where each node fits whole slices. None when the
    allowed CPUs are too few for every local worker to have its own."""
    ordered: list[int] = []
    for node in nodes:
        mine = sorted(node & allowed)
        usable = len(mine) - len(mine) % cores_per_worker if len(mine) >= cores_per_worker else len(mine)
        ordered.extend(mine[:usable])
    ordered.extend(sorted(allowed - set(ordered)))
    start = local_rank * cores_per_worker
    if cores_per_worker < 1 or start + cores_per_worker > len(ordered):
        return None
    return ordered[start : start + cores_per_worker]


def pin_worker(local_rank: int, local_workers: int, cpus_per_worker: float) -> list[int] | None:
    """Pin this process (all its threads, present and future) to its cores; the cores, or None
    where it is left unpinned (a fraction of a core each, too few cores, not Linux)."""
    if not hasattr(os, "sched_setaffinity") or cpus_per_worker < 1:
        return None
    allowed = os.sched_getaffinity(0)
    per = int(cpus_per_worker)
    if per * local_workers > len(allowed):
        log.info("cpu affinity: not pinned (%d workers x %d cores > %d allowed CPUs)", local_workers, per, len(allowed))
        return None
    cores = cores_for(local_rank, per, allowed, numa_nodes())
    if cores is None:
        return None
    os.sched_setaffinity(0, cores)
    for tid in _threads():  # threads started before now (Ray's, gRPC's) follow too
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, cores)
    log.info("cpu affinity: local rank %d pinned to cores %s", local_rank, ",".join(map(str, cores)))
    return cores


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []
