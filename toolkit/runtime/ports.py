"""Ports for the launches this process starts: a free loopback TCP port for a launcher's rendezvous."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it); the launch given it binds it moments later."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
