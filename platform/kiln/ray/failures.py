"""Failures of the Ray cluster itself, said as what they are.

A process Ray could not start in its runtime environment, a node that died or ran out of memory
or disk: none is a bug in Kiln or a mistake in the run's config, and a traceback says neither.
`cluster_failure_in` finds one behind whatever wraps it (Ray Train's worker-group error, Tune's
trial error), for the console's one line. It imports no Ray: where this process has not loaded
Ray, no failure can be Ray's, and the local launcher pays nothing for the check.
"""

from __future__ import annotations

import sys

from kiln.errors import failure_chain

# Ray's exception classes (ray.exceptions) that a cluster's machines cause: what each means for
# the run, and where its detail is.
CLUSTER_FAILURES = {
    "RuntimeEnvSetupError": (
        "Ray could not set up the runtime environment (working_dir, pip, env_vars) of a process it "
        "started for the run; the cause is in that node's Ray log runtime_env_setup-*.log, under "
        "session_latest/logs in Ray's temp dir (/tmp/ray unless the cluster set another)"
    ),
    "OutOfMemoryError": (
        "a Ray node ran out of memory and Ray's memory monitor killed a process of the run; "
        "`kiln plan` estimates a config's memory per worker"
    ),
    "OutOfDiskError": "a Ray node's disk is full (Ray spills its object store under its temp dir)",
    "ObjectStoreFullError": "Ray's object store on a node is full",
    "NodeDiedError": "a Ray node died (its raylet stopped) under the run",
    "LocalRayletDiedError": "this machine's Ray node (its raylet) died under the run",
}


def cluster_failure_in(failure: BaseException) -> tuple[BaseException, str] | None:
    """The Ray cluster failure behind `failure`, and what it means, if there is one."""
    exceptions = sys.modules.get("ray.exceptions")
    if exceptions is None:
        return None
    kinds = tuple(getattr(exceptions, name) for name in CLUSTER_FAILURES if hasattr(exceptions, name))
    for e in failure_chain(failure):
        if isinstance(e, kinds):
            name = next(c.__name__ for c in type(e).__mro__ if c.__name__ in CLUSTER_FAILURES)
            return e, CLUSTER_FAILURES[name]
    return None
