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
