"""The one protocol every transport implements; a new transport is one module beside this one.

A *streaming* transport moves each bucket from the PP stage's sender to the engines (`send`), inside
the begin/end weight-update session the executor opens; the version is then set by one final call.
A non-streaming transport (disk) moves the whole state by one call per engine (`load`) that also
carries the version. `prepare` runs on every rank before a sync's first pass; `forget` is told of
engines that came back (a restarted process is not in any group formed before).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Optional, Protocol, Sequence

from megatron_flash.weight_sync.calls import EngineCalls, Errors
from megatron_flash.weight_sync.plan import Bucket


@dataclasses.dataclass
class TransportContext:
    """What a transport may use; built once by the bridge."""

    calls: EngineCalls
    layout: Any
    """The trainer rank's parallel layout (pp_rank, pp_size, rank…)."""
    engine_tp_size: int
    master_address: str
    """Address engines reach the trainer's senders at (broadcast rendezvous)."""
    disk_dir: str
    export_hf: Callable[[str], None]
    """Collective HF export of the trainer's weights into a directory (disk)."""
    in_service: Callable[[], Sequence[str]]
    """The engines the bridge serves now (teardown messages go only to those)."""
    bucket_bytes: int = 512 * 2**20
    sender_bytes_bound: int = 2**62
    """At least what this rank ever sends in one sync (staging buffers need not be larger)."""


class Transport(Protocol):
    name: ClassVar[str]
    streams_buckets: ClassVar[bool]
    serial_stages: ClassVar[bool]
    """Under PP, stages take turns (a barrier after each stage's buckets)."""
    one_sender_per_stage: ClassVar[bool]
    """MoE under expert parallelism: the experts are gathered to the stage's sender instead of
    leaving from every EP rank (a transport whose group has one source)."""
    copies_buckets: ClassVar[bool]
    """The transport copies what it keeps, so buckets may hold views of the trainer's parameters."""

    def prepare(self, version: int) -> None: ...

    def send(self, bucket: Bucket, urls: list[str], step: str) -> Errors: ...

    def drain(self) -> Errors:
        """After a stage's buckets (and whenever a test hook wants them delivered): wait until every
        engine answered what `send` left in flight; the errors not returned yet."""

    def close(self) -> None:
        """The bridge shuts down: free what the transport holds (buffers, groups)."""

    def load(self, version: int, urls: list[str], verify_tensors: Optional[int] = None) -> Errors:
        """`verify_tensors`: the push carried checksums for this many tensors (delta.py), which the
        engine must verify before it takes the version."""

    def forget(self, urls: Sequence[str]) -> None: ...


class TransportDefaults:
    """Defaults every transport starts from: no per-engine state to forget, nothing left in flight to
    drain, nothing held to close."""

    serial_stages: ClassVar[bool] = False
    one_sender_per_stage: ClassVar[bool] = False
    copies_buckets: ClassVar[bool] = False

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx
        self.modes: set[str] = {"plain"}
        """The pass modes (delta.py) the coming sync runs; set by the bridge before `prepare`."""

    def forget(self, urls: Sequence[str]) -> None:
        pass

    def drain(self) -> Errors:
        return {}

    def close(self) -> None:
        pass


class StreamingTransport(TransportDefaults):
    """Defaults for transports that stream buckets."""

    streams_buckets: ClassVar[bool] = True

    def prepare(self, version: int) -> None:
        pass

    def load(self, version: int, urls: list[str], verify_tensors: Optional[int] = None) -> Errors:
        raise NotImplementedError(f"transport {self.name!r} streams buckets; it has no whole-state load")
