"""What a weight sync tells its caller: the report of a completed sync, the error of one that was not."""

from __future__ import annotations

import dataclasses
from typing import Optional


class WeightSyncError(RuntimeError):
    """A sync that did not complete; the message names the engine(s) and the step. `report` is the
    SyncReport when the sync got that far (engines out of service, probe numbers)."""

    def __init__(self, message: str, *, report: Optional["SyncReport"] = None) -> None:
        super().__init__(message)
        self.report = report


@dataclasses.dataclass
class SyncReport:
    version: int
    seconds: float
    bytes_sent: int
    """Over all passes and senders (a re-sync sends everything again)."""
    num_buckets: int
    transport: str
    synced_urls: list[str] = dataclasses.field(default_factory=list)
    """Engines serving `version` now."""
    failed_urls: list[str] = dataclasses.field(default_factory=list)
    """Engines taken out of service by this sync (paused, old weight_version, maybe partial weights)."""
    resynced_urls: list[str] = dataclasses.field(default_factory=list)
    """Engines that failed in the first pass and were re-synced from scratch (now in synced_urls)."""
    errors: dict[str, str] = dataclasses.field(default_factory=dict)
    """url → what went wrong, with the step (for every engine that had an error, re-synced or not)."""
    max_abs_logprob_diff: Optional[float] = None
    """Probe: max |trainer − engine| logprob per token over the synced engines (None: probe off)."""
    mean_abs_logprob_diff: Optional[float] = None
    """Probe: mean |trainer − engine| logprob per token (compared with probe_threshold)."""
    probe_seconds: float = 0.0
    delta_density: Optional[float] = None
    """Share of the values compared in delta passes whose bits changed (None: no delta pass)."""
    bytes_full: int = 0
    """What the same passes carry as whole tensors in the engine dtype (bytes_sent / bytes_full: the saving)."""
    anchor: bool = False
    """This push was a full anchor (weight_sync.delta_anchor_every)."""
    checksum_failures: int = 0
    """Engines whose checksums failed (or that lost a bucket) and were sent everything again."""
    delta_refused: int = 0
    """Engines that refused a delta (they serve another base version) and were sent everything."""
    modes: dict = dataclasses.field(default_factory=dict)
    """Pass mode (plain, full, delta) → engines that got it, first passes and re-syncs."""
    encode_seconds: float = 0.0
    """Trainer time to cast, compare and encode (summed over the senders)."""
    delta_copy_bytes: int = 0
    """The senders' kept engine-dtype copies (summed over ranks)."""

    def fill_delta(self, passes: list, *, anchor: bool, checksum_failures: int, delta_refused: int,
                   copy_bytes: int) -> None:
        delta = [p for p in passes if p.mode == "delta"]
        elements = sum(p.elements for p in delta)
        self.delta_density = sum(p.changed for p in delta) / elements if elements else None
        self.bytes_full = sum(p.bytes_full for p in passes)
        self.anchor, self.checksum_failures, self.delta_refused = anchor, checksum_failures, delta_refused
        self.modes = {}
        for p in passes:
            self.modes[p.mode] = self.modes.get(p.mode, 0) + p.engines
        self.encode_seconds = sum(p.encode_seconds for p in passes)
        self.delta_copy_bytes = copy_bytes
