"""Weight-sync transports by name: `ipc`, `broadcast`, `disk` (see base.py for the protocol)."""

from __future__ import annotations

from megatron_flash.weight_sync.transports.base import Transport, TransportContext
from megatron_flash.weight_sync.transports.broadcast import BroadcastTransport
from megatron_flash.weight_sync.transports.disk import DiskTransport
from megatron_flash.weight_sync.transports.ipc import IpcTransport

REGISTRY: dict[str, type] = {t.name: t for t in (IpcTransport, BroadcastTransport, DiskTransport)}
TRANSPORTS = tuple(REGISTRY)


def make_transport(name: str, ctx: TransportContext) -> Transport:
    if name not in REGISTRY:
        raise ValueError(f"weight_sync.transport must be one of {', '.join(TRANSPORTS)}, got {name!r}")
    return REGISTRY[name](ctx)


__all__ = ["TRANSPORTS", "Transport", "TransportContext", "make_transport"]
