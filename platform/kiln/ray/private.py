"""Ray's private APIs that Kiln uses, each where Ray has no public one. Checked against Ray 2.60.

Nothing else in Kiln imports a `_private` or `_internal` module of Ray's, or a private name
(`_name`) from its public modules (tests/unit/test_contracts.py checks).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any


def stdstream_dispatcher():
    """The driver's dispatcher of worker stdout/stderr lines (`add_handler`, `remove_handler`):
    how Kiln routes workers' lines to its console and the run's workers.log. Ray has no public
    hook for the lines its log monitor forwards."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher

    return global_worker_stdstream_dispatcher


def ray_up_problem(cluster: dict[str, Any]) -> str | None:
    """What `ray up` would refuse in a launcher config after filling in its defaults (its own
    `prepare_config` and `validate_config`, which have no public form), or None. Where the private
    API has moved, None: the JSON-schema check of the public schema still runs."""
    try:
        from ray.autoscaler._private.util import prepare_config, validate_config
    except ImportError:
        return None
    try:
        validate_config(prepare_config(copy.deepcopy(cluster)))
    except Exception as e:  # noqa: BLE001 - Ray raises ValueError, RuntimeError or schema errors
        return str(e).splitlines()[0]
    return None


def start_ray_helpers() -> None:
    """Start the two detached helper actors that Ray Train and Ray Data create on first use (Ray
    Data's autoscaling coordinator and its stats actor), without waiting for them. Each is a
    Python process that takes 2-3 s to start on a loaded 2-core machine. Left to Ray, the Train
    controller waits for the coordinator before it starts the workers, and the stats actor starts
    beside the first read, when every core is busy. Started here, both come up while the cores
    still have room (bench/results/startup.md). Ray creates both with `get_if_exists`, so its later
    calls find these. Where Ray has moved either function, nothing happens: Ray starts them later,
    as it would have."""
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )
        from ray.data._internal.stats import get_or_create_stats_actor
    except ImportError:
        return
    get_or_create_autoscaling_coordinator()
    get_or_create_stats_actor()


def without_dataset_sharding(callbacks: list) -> list:
    """Ray Train's default callbacks (`DataParallelTrainer._create_default_callbacks`) less the
    one that shards the trainer's `datasets` across its workers. That callback starts a
    `DatasetManager` actor in every worker group, even for a trainer given no datasets, and Kiln
    gives none: each worker reads its own rows (`kiln.ray.source`). The actor is a Python process
    that used 1.4-1.6 CPU-s while the workers imported; without it their import phase was 0.8-1.5 s
    shorter in each of nine alternated rounds (bench/results/startup.md). Ray has no switch for it.
    The driver's Ray Data settings (DataContext), which that callback also copied to the workers,
    are not needed there: each worker sets its own (`kiln.ray.source.configure_ray_data`). Where
    Ray has moved the callback, the list is returned as it is."""
    try:
        from ray.train.v2._internal.callbacks import DatasetsCallback
    except ImportError:
        return callbacks
    return [c for c in callbacks if not isinstance(c, DatasetsCallback)]


# Ray Train's torch process-group steps, for kiln.ray.process_group (whose docstring says why
# Kiln has its own backend). The first two run on the Train controller; the others on each
# worker, where they import Ray's torch module (and so torch), never on the controller.


def torch_framework():
    """Ray Train's tag for a torch run (its state export names the framework)."""
    from ray.train.v2._internal.util import TrainingFramework

    return TrainingFramework.TORCH


def rank0_address(worker_group) -> tuple[str, int]:
    """Rank 0's node address and a free port there: where the process group meets."""
    from ray.train._internal.utils import get_address_and_port

    return worker_group.execute_single(0, get_address_and_port)


def set_process_group_env(addr: str, port: int) -> None:
    """On a worker: what `init_process_group("env://")` reads (MASTER_ADDR, MASTER_PORT), and
    the ranks and sizes torchrun would set (RANK, LOCAL_RANK, WORLD_SIZE, ...), by Ray's function."""
    from ray.train.torch.config import _set_torch_distributed_env_vars

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    _set_torch_distributed_env_vars()


def init_process_group(backend: str, world_rank: int, world_size: int, timeout_s: int) -> None:
    """On a worker: Ray's `init_process_group` call, with its NCCL error-handling default."""
    from ray.train.torch.config import _setup_torch_process_group

    _setup_torch_process_group(backend, world_rank, world_size, "env://", timeout_s)


def shutdown_process_group(destroy: bool) -> None:
    """On a worker: Ray's teardown (the process group when `destroy`, and the CUDA cache)."""
    from ray.train.torch.config import _shutdown_torch

    _shutdown_torch(destroy_process_group=destroy)


def tune_stop_requested() -> Callable[[], bool]:
    """In a Tune function trial's training thread: a function saying whether Tune has asked the
    trial to stop (its scheduler's decision, or the sweep's end). It reads the trial session's
    stop event, held from now on, since Tune shuts the session down as it stops the trial.
    (`ray.train._internal.session`, Tune's function-trainable session.)"""
    from ray.train._internal.session import get_session

    session = get_session()
    return (lambda: False) if session is None else session.stop_event.is_set
