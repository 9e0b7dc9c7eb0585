"""Ray's private APIs that Kiln uses, each where Ray has no public one. Checked against Ray 2.60.

Nothing else in Kiln imports a `_private` module of Ray's (tests/unit/test_contracts.py checks).
"""

from __future__ import annotations

import copy
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
