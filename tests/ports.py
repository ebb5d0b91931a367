"""Loopback ports for the services a test starts.

A port the kernel hands out for `bind(0)` lies in its ephemeral range, from which it also picks the source port of
every outgoing connection. Between the test choosing such a port and the service binding it, any connection may
take it as its source port; a client that already dials the service (a gateway waiting for its tokenizer) may even
connect to itself on it. The service then fails with "address already in use". So ports come from below the
ephemeral range (and below `free_port_block`'s blocks in tests/k8s), never twice in one process, and only when
nothing listens on them now.
"""

from __future__ import annotations

import random
import socket

LOW, HIGH = 10000, 20000
"""Where single ports come from: below tests/k8s's port blocks (20000-32000) and Linux's ephemeral range (32768+)."""
_given: set[int] = set()
_rng = random.SystemRandom()


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a TCP socket could bind `host:port` now."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of `host` in [LOW, HIGH) that nothing listens on now and this process has not handed out before
    (random: parallel test workers rarely pick the same one)."""
    for _ in range(1000):
        port = _rng.randrange(LOW, HIGH)
        if port not in _given and port_free(port, host):
            _given.add(port)
            return port
    raise RuntimeError(f"no free port in [{LOW}, {HIGH}) after 1,000 tries")
