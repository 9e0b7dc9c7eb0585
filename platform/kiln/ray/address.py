"""A Ray address checked before anything waits on it.

Here rather than in kiln.launch.on_ray: `kiln data prepare` checks its --address too, and
importing the training launcher would load torch and Ray Train into a prepare's driver
(2 s and about 300 MiB of RSS that a prepare never uses).
"""

from __future__ import annotations

import socket

from kiln.errors import ConfigError, KilnError


def check_ray_address(address: str, timeout: float = 5.0) -> None:
    """Refuse an address where nothing listens: `ray.init` would wait for it without end."""
    if address == "auto" or address.startswith("local"):
        return
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not port.isdigit():
        raise ConfigError(
            f"Ray address {address!r}: expected host:port (the head's GCS port, 6379 by default) or ray://host:port"
        )
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise KilnError(
            f"no Ray cluster answers at {address} ({e.strerror or e}): start one with "
            "`ray start --head`, or correct --address / $RAY_ADDRESS"
        ) from None
