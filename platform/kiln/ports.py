"""A free TCP port on loopback, for a server Kiln starts on this machine (torch's rendezvous,
an embedded Ray's dashboard)."""

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
