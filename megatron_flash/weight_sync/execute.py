"""Execute a sync: passes to a set of engines, all trainer ranks taking part, and re-syncs.

One pass:
  rank 0    pause → (colocated: take back the weights' memory) → begin_weight_update   (per engine)
  senders   stream their buckets through the transport (a weight_version never travels with a bucket)
  rank 0    update_weight_version(v) → end_weight_update → flush_cache → (colocated: KV memory)
            → continue_generation → read back weight_version             (only engines with no error)
The version is advanced by that one final call, so an engine that got part of the buckets still
reports the old version; the proxy never re-admits it (its version ≠ the fleet's). A non-streaming
transport (disk) replaces begin/buckets/version/end by one load call per engine that carries the version.

A pass has a mode (delta.py): every bucket goes through the encoder on its way to the transport (plain:
cast at most; full and delta: checksums, and the final call carries how many tensors the engines must
verify). Disk with checksums writes the encoded buckets as files, then loads them by one call per engine.

An engine with any error in a pass is *dirty*: it may hold part of the buckets, so it stays paused
(it must not serve mixed weights) and, if it still answers, gets a whole new pass to it alone, up to
`max_resync` times. Engines without an error are resumed on every path.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch.distributed as dist

from megatron_flash.trace import TRACER, TRAINER
from megatron_flash.weight_sync.calls import EngineCalls, Errors, from_rank0, merge_errors, sum_over_ranks
from megatron_flash.weight_sync.colocate import MemoryHandoff
from megatron_flash.weight_sync.delta import DeltaEncoder
from megatron_flash.weight_sync.plan import bucket_nbytes, hf_buckets
from megatron_flash.weight_sync.transports import Transport


@dataclasses.dataclass
class Outcome:
    errors: Errors
    """Engines still dirty after every re-sync: url → the first pass's error and each re-sync's."""
    first_errors: Errors
    """Engines with an error in the first pass (re-synced or not)."""
    resynced: list[str]
    bytes_sent: int
    num_buckets: int
    passes: list["PassStats"] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class PassStats:
    """One pass, summed over the senders."""

    mode: str
    engines: int
    bytes_sent: int
    bytes_full: int
    elements: int
    changed: int
    tensors: int
    encode_seconds: float


class Executor:
    def __init__(self, policy: Any, transport: Transport, calls: EngineCalls, *, bucket_bytes: int,
                 pause_mode: str, memory: Optional[MemoryHandoff], encoder: Optional[DeltaEncoder] = None,
                 on_bucket: Optional[Callable[[int], None]] = None) -> None:
        self.policy, self.transport, self.calls = policy, transport, calls
        self.encoder = encoder or DeltaEncoder(None)
        self.mode, self.base, self._trainer_failed = "plain", None, False
        self.bucket_bytes, self.pause_mode, self.memory, self.on_bucket = bucket_bytes, pause_mode, memory, on_bucket
        self.rank0 = policy.layout.rank == 0

    def run(self, version: int, targets: list[str], *, max_resync: int, mode: str = "plain",
            base: Optional[int] = None) -> Outcome:
        """Bring `targets` to `version`: one pass in `mode` (delta.py: plain, full, or delta against
        `base`), then re-syncs of the dirty engines that answer (everything again: full, or plain for
        engines that take no delta). Collective."""
        passes: list[PassStats] = []
        errors, sent, buckets = self._pass(version, targets, mode=mode, base=base, stats=passes)
        first_errors = dict(errors)
        resynced: list[str] = []
        for attempt in range(max_resync):
            retry = self.calls.alive(sorted(errors), rank0=self.rank0) if errors else []
            if not retry:
                break
            again, s, b = self._pass(version, retry, resync=True, mode="plain" if mode == "plain" else "full",
                                     stats=passes)
            sent, buckets = sent + s, buckets + b
            for url in retry:
                if url in again:
                    errors[url] = f"{errors[url]}; re-sync {attempt + 1}: {again[url]}"
                else:
                    errors.pop(url)
                    resynced.append(url)
        return Outcome(errors, first_errors, resynced, sent, buckets, passes)

    def _pass(self, version: int, targets: list[str], *, resync: bool = False, mode: str = "plain",
              base: Optional[int] = None, stats: Optional[list] = None) -> tuple[Errors, int, int]:
        """One attempt to bring `targets` to `version`. Collective. Returns (errors, bytes, buckets)."""
        self.mode, self.base, self._trainer_failed = mode, base, False
        self.encoder.start_pass()
        streaming = self.transport.streams_buckets
        files = not streaming and mode != "plain"  # disk with checksums: the buckets are written as files
        errors: Errors = {}
        if self.rank0:  # the trace's push phases (pause, buckets, resume) are rank 0's (trace.py)
            with TRACER.span("pause", "sync", TRAINER, engines=len(targets), mode=self.pause_mode, resync=resync):
                errors = self._pause(targets, resync=resync)
        errors = from_rank0(errors)
        active = [u for u in targets if u not in errors]
        local: Errors = {}
        sent = buckets = 0
        with TRACER.span("buckets", "sync", TRAINER, engines=len(active), transport=self.transport.name,
                         mode=mode) as info:
            if active and (streaming or files):
                if files:
                    self.transport.start_files(version, mode)
                local, sent, buckets = self._stream(active)
            info.update(buckets=buckets, bytes=sent)  # this rank's
        errors.update(merge_errors(local))
        st = self.encoder.stats
        totals = sum_over_ranks(sent, buckets, st.tensors, st.elements, st.changed, st.bytes_full,
                                int(st.seconds * 1e6), int(self._trainer_failed))
        sent, buckets, tensors = totals[0], totals[1], totals[2]
        if totals[7]:
            self.encoder.invalidate()  # a trainer-side failure midway: some rank's copy is partial
        elif active and mode != "plain":
            self.encoder.commit(version)  # every sender's copy saw every tensor of `version`
        verify = tensors if mode != "plain" else None
        if active and not streaming and self.rank0:
            local = self.transport.load(version, [u for u in active if u not in errors], verify_tensors=verify)
            errors.update(local)
            if not files:
                sent = getattr(self.transport, "loaded_bytes", 0)  # adapters: what each engine was sent
        if self.rank0:
            with TRACER.span("resume", "sync", TRAINER, engines=len(active)):
                errors.update(self._finish(version, active, errors, verify=verify))
        errors = from_rank0(errors)
        if not streaming and not files:
            sent = from_rank0(sent)  # adapters: rank 0 knows what each engine was sent
        if stats is not None and active:
            stats.append(PassStats(mode, len(active), sent, totals[5], totals[3], totals[4], tensors,
                                   totals[6] / 1e6))
        return errors, sent, buckets

    def _pause(self, targets: list[str], *, resync: bool) -> Errors:
        """Rank 0, before the transfer: pause the engines and open their weight-update sessions."""
        fan, streaming = self.calls.fan, self.transport.streams_buckets
        _, errors = fan("pause_generation", targets, lambda c: c.pause_generation(self.pause_mode))
        if self.memory is not None:  # the weights' memory first (values arrive with this pass), KV after it
            errors.update(self.memory.resume([u for u in targets if u not in errors], ["weights"],
                                             "resume_memory_occupation(weights)"))
        if streaming and resync:  # a session left open (by the failed pass, or a crashed trainer) blocks begin
            fan("end_weight_update", [u for u in targets if u not in errors], lambda c: c.end_weight_update(),
                session=True, retries=0)
        if streaming:
            _, begin = fan("begin_weight_update", [u for u in targets if u not in errors],
                           lambda c: c.begin_weight_update(), session=True)
            errors.update(begin)
        return errors

    def _finish(self, version: int, active: list[str], errors: Errors, *, verify: Optional[int] = None) -> Errors:
        """Rank 0, after the transfer: set the version on the engines that got everything, close, resume."""
        fan = self.calls.fan
        new: Errors = {}

        def ok() -> list[str]:
            return [u for u in active if u not in errors and u not in new]

        if self.transport.streams_buckets:
            _, e = fan("update_weight_version", ok(), lambda c: c.update_weight_version(str(version),
                                                                                       verify_tensors=verify))
            new.update(e)
            _, e = fan("end_weight_update", active, lambda c: c.end_weight_update(), session=True)
            new.update({u: m for u, m in e.items() if u in ok()})  # a dirty engine's failed end is no news
        if self.pause_mode != "in_place":
            new.update(fan("flush_cache", ok(), lambda c: c.flush_cache())[1])
        if self.memory is not None:
            new.update(self.memory.resume(ok(), ["kv_cache", "cuda_graph"], "resume_memory_occupation(kv_cache)"))
        new.update(fan("continue_generation", ok(), lambda c: c.continue_generation())[1])
        versions, e = fan("get_weight_version", ok(), lambda c: c.get_weight_version())
        new.update(e)
        new.update({u: f"read back: reports weight_version {v!r}, expected {str(version)!r}"
                    for u, v in versions.items() if v != str(version)})
        return new

    def _stream(self, active: list[str]) -> tuple[Errors, int, int]:
        """Every rank: drive this stage's buckets; senders push them. Returns this rank's errors."""
        layout = self.policy.layout
        errors: Errors = {}
        sent = count = 0
        serial = self.transport.serial_stages and layout.pp_size > 1
        for stage in range(layout.pp_size):
            if stage == layout.pp_rank:
                buckets = hf_buckets(self.policy, bucket_bytes=self.bucket_bytes,
                                     gather_experts=self.transport.one_sender_per_stage,
                                     copy=not self.transport.copies_buckets)
                for index, bucket in enumerate(buckets):
                    live = [u for u in active if u not in errors]
                    step = f"PP stage {stage} bucket {index}"
                    try:
                        # Encoded even when no engine is left: the kept copy must see every tensor.
                        bucket = self.encoder.encode(bucket, self.mode, base=self.base)
                        if live:
                            with TRACER.span("bucket", "sync", TRAINER, stage=stage, index=index,
                                             bytes=bucket_nbytes(bucket)):
                                errors.update(self.transport.send(bucket, live, step))
                        sent += bucket_nbytes(bucket)
                        count += 1
                        if self.on_bucket is not None:  # "went out" = the engines have it
                            self._merge(errors, self.transport.drain())
                            self.on_bucket(index)
                    except Exception as error:  # a trainer-side failure: every engine may be partial
                        self._trainer_failed = True
                        errors.update({u: f"{step}: trainer rank {layout.rank}: {type(error).__name__}: {error}"
                                       for u in live if u not in errors})
                    del bucket  # keeps peak memory at one bucket (ipc: the engines answered, files can go)
                try:
                    self._merge(errors, self.transport.drain())  # what is still in flight
                except Exception as error:
                    self._trainer_failed = True
                    errors.update({u: f"PP stage {stage} (last buckets): trainer rank {layout.rank}: "
                                      f"{type(error).__name__}: {error}" for u in active if u not in errors})
            if serial:
                dist.barrier()
        return errors, sent, count

    @staticmethod
    def _merge(errors: Errors, more: Errors) -> None:
        for url, message in more.items():
            errors.setdefault(url, message)
