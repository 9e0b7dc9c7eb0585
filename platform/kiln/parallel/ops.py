"""DeepSpeed's JIT-compiled ops (the CPU shared-memory allreduce, CPU Adam): their cache and
their build at install time.

DeepSpeed compiles these ops with torch's cpp_extension into one cache that every Python on
the machine shares (~/.cache/torch_extensions). Two problems with that, both measured here:
- Two virtual environments thrash it. Each sees the other's build as out of date (their torch
  include paths differ) and builds again, 70-85 s inside the next run's start-up.
- A build killed midway leaves its lock file behind. torch waits on it without end, so every
  later run hangs in its first DeepSpeed call.

So Kiln keeps the cache inside the environment (`TORCH_EXTENSIONS_DIR`, unless the user set
it) and removes a lock older than any build. `python -m kiln.parallel.ops` builds both ops
there, once, at install (`make install`), so that no run compiles them. Every process that
starts DeepSpeed's comm layer does so through `init_distributed`, which points the cache first:
on a CPU that call loads the shm allreduce.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib
import logging
import os
import sys
import time

from kiln.devices import dist_backend
from kiln.guard import remove_file
from kiln.parallel.comm_bytes import COUNTER

log = logging.getLogger(__name__)

# The slowest op (cpu_adam) builds in about 2 minutes on 2 cores; a lock this old is left over.
STALE_LOCK_S = 20 * 60


def use_environment_cache() -> str:
    """Point torch's extension cache into this environment (once per process, before DeepSpeed
    loads an op) and clear a stale build lock there. Returns the cache directory."""
    path = os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    for lock in glob.glob(os.path.join(path, "*", "lock")):
        with contextlib.suppress(FileNotFoundError):  # another process may finish and remove it
            age = time.time() - os.path.getmtime(lock)
            if age > STALE_LOCK_S:
                log.warning(
                    "removing %s: an op build that died %d min ago left it, and every run would wait on it",
                    lock,
                    age // 60,
                )
                remove_file(lock, proof="a stale build lock in this environment's own op cache")
    return path


def init_distributed(on_cuda: bool) -> None:
    """DeepSpeed's comm layer over the torch process group that Ray Train or torchrun set up (a
    no-op if done already), its JIT ops taken from this environment's cache. On a CPU the call
    loads the shm allreduce: made before the cache was pointed, it compiled that op into the
    shared cache inside the local launcher's start-up (29 s on 2 cores where that cache was
    empty or another environment's)."""
    use_environment_cache()
    COUNTER.install()  # before DeepSpeed's comm layer keeps its own references to the collectives
    COUNTER.timed = not on_cuda  # NCCL's calls return before the work is done: no host time
    backend = dist_backend(on_cuda)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        init_world_of_one(backend)
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend=backend)  # over the group made above, if one was


def init_world_of_one(backend: str) -> None:
    """A world of one process needs no rendezvous: its group is made over an in-process store.
    An env:// rendezvous would bind a TCP port picked beforehand, and another process (a second
    local run, or any connection's ephemeral port) can take it between the pick and the bind:
    CI once failed a run with EADDRINUSE that way, four local runs starting side by side."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def import_deepspeed():
    """`import deepspeed` without the MLflow import that its autotuner module tries on load
    (0.85-1.0 s alone; the demo's non-logging rank used 0.3-0.5 CPU-s less by its first step,
    bench/results/startup.md): Kiln never runs DeepSpeed's autotuner, and a rank that logs
    nothing needs no MLflow. A process that imported MLflow already (the rank that logs, the
    driver) imports DeepSpeed as it is. DeepSpeed's Muon comes with it, its compile wrappers made
    on first use (`_import_muon_compiling_lazily`). Called first by every worker's comm set-up
    (`init_distributed`), so DeepSpeed is not imported before it there."""
    hide = "deepspeed" not in sys.modules and "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # `import mlflow` fails; the autotuner catches it
    try:
        import deepspeed
    finally:
        if hide and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]  # MLflow imports normally from here on
    _import_muon_compiling_lazily()
    return deepspeed


# DeepSpeed's Muon, whose import wraps three functions in torch.compile.
_MUON = ("deepspeed.runtime.zero.muon.original_muon", "deepspeed.runtime.zero.muon.muon_optimizer")


def _import_muon_compiling_lazily() -> None:
    """Import DeepSpeed's Muon modules with their `torch.compile` wrappers made on first call.

    ZeRO-1 and -2 import Muon in every step's gradient partitioning, and every ZeRO stage's
    optimizer set-up checks for it, so each rank imports it whatever its optimizer. The import
    calls `torch.compile` on three functions, and that loads about 160 of inductor's modules:
    1.5-2.1 CPU-s a rank on 2 cores (bench/results/startup.md), for functions that only a Muon
    optimizer calls, and no Kiln optimizer is Muon. Here each wrapper is made on its function's
    first call instead, where `torch.compile` would compile it anyway. DeepSpeed has no switch
    for this. Where its Muon has moved, or was imported already, nothing changes."""
    if any(name in sys.modules for name in _MUON):
        return
    from deepspeed.runtime import compiler

    eager = compiler.compile

    def on_first_call():  # the shape of compiler.compile(): a decorator factory
        def decorate(fn):
            compiled = None

            @functools.wraps(fn)
            def call(*args, **kwargs):
                nonlocal compiled
                if compiled is None:
                    compiled = eager()(fn)
                return compiled(*args, **kwargs)

            return call

        return decorate

    compiler.compile = on_first_call
    try:
        for name in _MUON:
            importlib.import_module(name)
    except ImportError:
        pass
    finally:
        compiler.compile = eager


def shutdown_distributed() -> None:
    """After a run that every rank finished: wait for all, then tear the process group down
    before the interpreter exits. Left to the interpreter's exit, gloo's threads can be
    destroyed while still joinable, and a rank aborts (SIGABRT, "terminate called without an
    active exception") after its work is done, failing the whole torchrun launch."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def prebuild() -> None:
    """Build (or find built) the ops Kiln's CPU runs load. A failure is logged, not raised: the
    shm allreduce falls back to gloo, and an optimizer offload tries to build cpu_adam again when
    first used (and preflight names what is missing)."""
    from deepspeed.ops.op_builder import CPUAdamBuilder
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    cache = use_environment_cache()
    for builder, why in (
        (ShareMemCommBuilder, "CPU allreduce falls back to gloo"),
        (CPUAdamBuilder, "optimizer offload will try again when first used"),
    ):
        try:
            builder().load(verbose=False)
            log.info("DeepSpeed op %s ready in %s", builder.NAME, cache)
        except Exception as e:  # noqa: BLE001 - reported, and the run has a way around each
            log.warning("DeepSpeed op %s did not build (%s): %s", builder.NAME, e, why)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    prebuild()
