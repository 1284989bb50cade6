"""Free ports for the services of a stack to listen on.

A port is picked below the kernel's ephemeral range where there is room, and never
handed out twice in one process: a port the kernel could also give an outgoing
connection may be taken between the check and the service's bind, or before a
restarted service binds it again.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# The lowest port `free_port` picks (below the kernel's ephemeral range).
PORTS_FROM = 20000

# Ports handed out by `free_port` in this process, never handed out twice.
_handed_out: set[int] = set()
_random = random.SystemRandom()


def _ephemeral_floor() -> int:
    """The lowest port the kernel gives outgoing connections (0 when unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port(address: str = "127.0.0.1") -> int:
    """A port free on `address` for a service to listen on, below the kernel's ephemeral
    range where there is room (any free port the kernel picks otherwise)."""
    floor = _ephemeral_floor()
    if floor > PORTS_FROM + 1000:
        for _ in range(100):
            port = _random.randrange(PORTS_FROM, floor)
            if port in _handed_out:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind((address, port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])
