"""A slow link, simulated: with KILN_BENCH_LINK_MBPS set, every torch.distributed collective
waits, after it returns, for the time its ring bytes (`kiln.parallel.comm_bytes`'s rule) take
at that many megabits a second. `bench.sync` puts this folder on PYTHONPATH for its slow-link
runs, so every process of the run (Ray's workers too) loads it; without the variable it does
nothing. Loopback cannot be throttled here without root (`tc` needs CAP_NET_ADMIN), so the
delay is injected instead, and the results say so.

It wraps torch.distributed.distributed_c10d's functions as that module loads (an import hook),
before torch.distributed re-exports them and before Kiln's byte counter wraps them in turn, so
the counter's `comm/time_s` includes the wait.
"""

import importlib.machinery
import os
import sys
import time

RATE = os.environ.get("KILN_BENCH_LINK_MBPS")
TARGET = "torch.distributed.distributed_c10d"


def _slowed(name, original, bits_per_s):
    def slowed(*args, **kwargs):
        out = original(*args, **kwargs)
        from kiln.parallel.comm_bytes import _sent  # the one rule for a call's bytes

        time.sleep(_sent(name, args, kwargs) * 8 / bits_per_s)
        return out

    return slowed


class _Hook:
    """Wraps the collectives of TARGET once it has run, then steps aside."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            from kiln.parallel.comm_bytes import SENDS

            for fn in SENDS:
                if hasattr(module, fn):
                    setattr(module, fn, _slowed(fn, getattr(module, fn), float(RATE) * 1e6))

        spec.loader.exec_module = exec_module
        return spec


if RATE:
    sys.meta_path.insert(0, _Hook())
