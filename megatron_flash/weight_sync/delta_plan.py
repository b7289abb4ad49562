"""Which engines get a delta, which get everything: the bridge's bookkeeping for `weight_sync.delta`.

An engine gets a delta only when all of these hold; otherwise a full push (with checksums) or, for an
engine that takes no delta (SGLang), a plain one:
- it advertised `weight_update_delta` in /get_server_info, with the dtype the kept copy is in;
- this bridge brought it to the kept copy's version (`versions`), and nothing since said otherwise:
  a failed or re-synced push, a readmitted (restarted) engine, or an engine new to the bridge;
- the kept copy is whole on every sender (no pass failed midway on the trainer's side);
- this push is not an anchor (every `anchor_every`-th push goes whole to every engine).
The engine checks the base version itself too (a restart the bridge did not see): it refuses, and
the executor's re-sync sends it everything.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch

from megatron_flash.weight_sync.calls import EngineCalls, from_rank0, sum_over_ranks
from megatron_flash.weight_sync.delta import DeltaEncoder

logger = logging.getLogger(__name__)


class DeltaPlan:
    def __init__(self, *, mode: str, anchor_every: int, engine_dtype: Optional[str], max_density: float,
                 calls: EngineCalls, rank0: bool) -> None:
        if mode not in ("off", "on", "auto"):
            raise ValueError(f"weight_sync.delta must be off, on or auto, got {mode!r}")
        if anchor_every < 0:
            raise ValueError(f"weight_sync.delta_anchor_every must be >= 0, got {anchor_every!r}")
        self.mode, self.anchor_every, self.calls, self.rank0 = mode, anchor_every, calls, rank0
        self.dtype_name = engine_dtype or ""
        dtype = getattr(torch, engine_dtype) if engine_dtype else None
        self.encoder = DeltaEncoder(dtype, max_density=max_density)
        self.encoder.plain_cast = dtype is not None
        self.capable: dict[str, bool] = {}
        self.versions: dict[str, int] = {}
        """Engines this bridge brought to a version with checksums verified: url → version."""
        self.pushes = 0
        self.checksum_failures = 0
        self.refusals = 0

    @property
    def enabled(self) -> bool:
        """on: every engine must take deltas (one that does not is refused by URL); auto: those that do."""
        return self.mode != "off"

    def forget(self, urls: Sequence[str]) -> None:
        for url in urls:
            self.versions.pop(url, None)
            self.capable.pop(url, None)

    def _discover(self, urls: list[str]) -> None:
        """Rank 0 asks new engines whether they take deltas and in which dtype; every rank learns it."""
        new = [u for u in urls if u not in self.capable]
        found: dict[str, Any] = {}
        if new and self.rank0:
            infos, errors = self.calls.fan("get_server_info", new, lambda c: c.server_info(), retries=1)
            for url in new:
                info = infos.get(url, {})
                dtype = str(info.get("dtype", ""))
                if not info.get("weight_update_delta"):
                    found[url] = (False, "takes no delta (no weight_update_delta in /get_server_info)"
                                  if url not in errors else errors[url])
                elif self.dtype_name and dtype != self.dtype_name:
                    found[url] = (False, f"serves {dtype or 'an unknown dtype'}, the kept copy is {self.dtype_name}")
                else:
                    found[url] = (True, dtype)
        found = from_rank0(found)
        for url, (ok, detail) in found.items():
            if ok and not self.dtype_name:
                self.dtype_name = detail
                self.encoder.engine_dtype = getattr(torch, detail)
            elif ok and detail != self.dtype_name:
                ok, detail = False, f"serves {detail}, the kept copy is {self.dtype_name}"
            self.capable[url] = ok
            if not ok:
                logger.warning("weight sync: %s gets whole pushes: %s", url, detail)
                if self.mode == "on" and "takes no delta" in detail:
                    raise ValueError(f"weight_sync.delta=on but engine {url} {detail}; use weight_sync.delta=auto")

    def groups(self, version: int, targets: list[str]) -> tuple[list[tuple[str, list[str]]], bool]:
        """[(mode, engines)] in the order to run them (delta first: it needs the kept copy's base), and
        whether this push is an anchor. Collective."""
        if not self.enabled:
            return [("plain", list(targets))], False
        self._discover(targets)
        invalid = sum_over_ranks(int(self.encoder.base_version is None))[0] > 0
        anchor = self.anchor_every > 0 and self.pushes % self.anchor_every == 0
        base = self.encoder.base_version
        delta, full, plain = [], [], []
        for url in targets:
            if not self.capable[url]:
                plain.append(url)
            elif not invalid and not anchor and self.versions.get(url) == base:
                delta.append(url)
            else:
                full.append(url)
        if delta or full:
            self.pushes += 1
        anchor = anchor and bool(full)
        return [(m, g) for m, g in (("delta", delta), ("full", full), ("plain", plain)) if g], anchor

    def settle(self, version: int, ran: list[tuple[str, list[str]]], errors: dict[str, str],
               all_errors: dict[str, str]) -> dict[str, int]:
        """After the passes: who holds `version` with checksums verified; counts of what failed."""
        counts = {"checksum_failures": 0, "delta_refused": 0}
        for mode, urls in ran:
            for url in urls:
                if mode != "plain" and url not in errors:
                    self.versions[url] = version
                else:
                    self.versions.pop(url, None)
        for url, message in all_errors.items():
            if "checksum" in message or "a bucket was lost" in message:
                counts["checksum_failures"] += 1
                logger.warning("weight sync to version %d: %s failed its checksums and was sent everything: %s",
                               version, url, message)
            elif "delta refused" in message:
                counts["delta_refused"] += 1
                logger.warning("weight sync to version %d: %s refused the delta and was sent everything: %s",
                               version, url, message)
        self.checksum_failures += counts["checksum_failures"]
        self.refusals += counts["delta_refused"]
        return counts
