"""Loopback/TCP helpers shared by launchers, trainers and tests."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LINUX_EPHEMERAL = (32768, 60999)  # the kernel's default, where the file cannot be read
# Below 20000: well-known services and Ray's worker ports (10002-19999 by default).
LOWEST_PORT = 20000
_TRIES = 64


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The ports the kernel hands to outgoing connections and ``bind(0)``: ``(low, high)``."""
    try:
        low, high = Path(path).read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return LINUX_EPHEMERAL


def port_candidates(ephemeral: tuple[int, int], lowest: int = LOWEST_PORT) -> list[range]:
    """The port ranges at or above ``lowest`` that lie outside ``ephemeral``."""
    low, high = ephemeral
    ranges = [range(lowest, min(low, 65536)), range(max(high + 1, lowest), 65536)]
    return [r for r in ranges if len(r)]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now, chosen outside the ephemeral range.

    The caller hands the port to another process, which binds it moments later. A port the
    kernel picked (``bind(0)``) lies in the range it also gives every outgoing connection, so in
    those moments a connection of any process (Ray opens hundreds) may take it: the listener
    then fails with EADDRINUSE. A random port outside that range can only be taken by another
    caller drawing the same one. Where no range is left (a machine whose ephemeral range covers
    20000-65535), the kernel's pick is the only choice and is returned.
    """
    ranges = port_candidates(ephemeral_range())
    draw = random.SystemRandom()  # not the seeded module state: every process draws its own
    for _ in range(_TRIES if ranges else 0):
        port = draw.choice(draw.choices(ranges, weights=[len(r) for r in ranges])[0])
        if _bindable(host, port):
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True
