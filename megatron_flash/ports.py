"""Free TCP ports on one host, for engines (base_port + i), rendezvous and weight-update groups.

A port handed out by binding port 0 comes from the kernel's ephemeral range, the same range every
outgoing connection draws its local port from: between the check and the server's own bind, a client
socket of this process (HTTP to an engine, gloo, a TCPStore) can take it, and the engine then fails
with "address already in use" (seen in CI: engine 1 of 2 at base + 1). So the ports come from below
the ephemeral range, where no outgoing connection lands, and each one is checked by binding it.

`MF_PORT_RANGE=LO-HI` confines the draws to [LO, HI]: several jobs (or test workers) on one host each
get a range of their own, so two of them cannot draw the same port between the check and the bind.
"""

from __future__ import annotations

import os
import random
import socket

_LOW = 20000  # above the well-known and most registered service ports


def ephemeral_range() -> tuple[int, int]:
    """The kernel's local port range for outgoing connections (Linux default 32768-60999)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def port_range_from_env() -> tuple[int, int] | None:
    """MF_PORT_RANGE as (lo, hi), inclusive; None when unset. A malformed value names the variable."""
    raw = os.environ.get("MF_PORT_RANGE", "").strip()
    if not raw:
        return None
    try:
        lo, hi = (int(x) for x in raw.split("-"))
    except ValueError:
        raise ValueError(f"MF_PORT_RANGE={raw!r}: expected LO-HI, two port numbers (e.g. 20000-25999)") from None
    if not 1024 <= lo <= hi <= 65535:
        raise ValueError(f"MF_PORT_RANGE={raw!r}: need 1024 <= LO <= HI <= 65535")
    return lo, hi


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(count: int = 1, host: str = "127.0.0.1") -> int:
    """The first of `count` consecutive ports that are free on `host` now, outside the ephemeral range
    where possible (released before return: the caller's servers bind them)."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    confined = port_range_from_env()
    if confined is not None:
        spans = [(confined[0], confined[1] - count + 2)]  # randrange's end is exclusive
        if spans[0][1] <= spans[0][0]:
            raise RuntimeError(f"MF_PORT_RANGE={confined[0]}-{confined[1]} holds fewer than {count} ports")
    else:
        lo, hi = ephemeral_range()
        spans = [(a, b) for a, b in ((_LOW, lo - count), (hi + 1, 65535 - count + 1)) if b > a]
    rng = random.Random()  # not the seeded global RNG: runs with one seed must not pick the same ports
    for _ in range(200):
        if spans:
            a, b = rng.choice(spans)
            base = rng.randrange(a, b)
        else:  # an unusual kernel setting leaves no room: take what binding port 0 gives
            with socket.socket() as s:
                s.bind((host, 0))
                base = s.getsockname()[1]
            if base + count > 65536:
                continue
        if all(_bindable(p, host) for p in range(base, base + count)):
            return base
    where = f" in MF_PORT_RANGE={confined[0]}-{confined[1]}" if confined is not None else ""
    raise RuntimeError(f"no {count} consecutive free ports on {host}{where}")
