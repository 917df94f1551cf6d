"""Ports for the launches this process starts: a free loopback TCP port for a launcher's rendezvous."""

from __future__ import annotations

import random
import socket

FLOOR = 10000  # the lowest port drawn: above the well-known and most registered service ports
_draw = random.SystemRandom()  # not the `random` module's state: a run's seed (set_seed) would repeat its draws


def ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        with open(path) as ranges:
            return int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now; the launch given it binds it moments later.

    Drawn at random below the kernel's ephemeral range: a port the kernel picks (a bind to port 0) is one it also
    hands to outgoing connections, so any process on the host connecting meanwhile (another job's ranks, its gloo
    pairs, its store clients) could take it before the launcher binds it, and the launch fails with a lost store
    ("Failed to recv"). Below the range only another explicit choice can take it, and two random draws rarely meet.
    Where the range leaves nothing below it, the kernel picks."""
    low = ephemeral_low()
    for _ in range(64 if low - FLOOR >= 1024 else 0):
        port = _draw.randrange(FLOOR, low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
