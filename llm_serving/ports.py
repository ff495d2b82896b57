"""Loopback ports for a server another process binds later: the local server harness (bench/local_server.py), the
rehearsal (rehearsal/), the benchmarks and the tests draw them here, the one way to do it."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def _ephemeral_range_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port free now, for a server another process binds later (often tens of seconds later, after the engine).

    Not from the kernel's ephemeral range (a bind to port 0): until the server binds it, such a port can be handed to
    any outgoing connection on the machine as its local port, and the server then fails with "Address already in
    use" (seen on a loaded CI machine). Ports below that range are never handed out that way. Drawn with the
    system's randomness, so that processes with the same seed do not draw the same ports."""
    high = min(_ephemeral_range_start(), 32768)
    draw = random.SystemRandom()
    for _ in range(1000):
        port = draw.randrange(high - 12000, high)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {high}")


def accepts(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on `host:port` now (a connection attempt of at most 0.2 s)."""
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0
