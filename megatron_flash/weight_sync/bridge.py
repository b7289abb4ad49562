"""Push the trainer's weights to the engines after an optimizer step: plan → execute → transport.

  plan      every PP stage has one *sender* (TP rank 0, DP rank 0); within the stage all TP ranks
            all-gather each parameter (collectives), the sender turns it into HF tensors (name map,
            vocab padding stripped) and groups them into buckets of `bucket_mb`;
  execute   one *pass* to a set of engines, all ranks taking part:
              rank 0    pause → begin_weight_update                        (per engine)
              senders   stream their buckets (weight_version never sent with a bucket)
              rank 0    update_weight_version(v) → end_weight_update → flush_cache → continue_generation
                        → read back weight_version                        (only engines with no error)
            The version is advanced by that one final call, so an engine that got part of the buckets
            still reports the old version; the proxy never re-admits it (its version ≠ the fleet's).
  transport ipc        bucket → ForkingPickler payload (CUDA IPC / shared memory, `file_system`
                       strategy) → POST /update_weights_from_tensor to every engine
            broadcast  one gloo/NCCL group per PP stage: {that stage's sender (rank 0)} ∪ {every engine
                       rank}; stages take turns (a barrier between them) because an engine serves one
                       update at a time: two stages broadcasting at once to two engines that picked
                       them in opposite orders would deadlock. POST /update_weights_from_distributed
                       announces names/dtypes/shapes while the sender broadcasts each tensor.
            disk       HF safetensors export (atomic) → POST /update_weights_from_disk, which carries
                       the version itself (one call per engine: it is the final call)

Failure midway: an engine with any error in a pass is *dirty* — it may hold part of the
buckets. It stays paused (it must not serve mixed weights) and, if it still answers, is re-synced from
scratch (a whole new pass to it alone, `max_resync` times). One that cannot be re-synced is taken out of
service: removed from this bridge's engines, listed in `SyncReport.failed_urls`, left paused with its old
weight_version. `fail_fast` raises `WeightSyncError` naming the engine and the step; otherwise the caller
reads the report and stops routing to it (a sync that leaves no engine serving always raises). Engines
without an error are resumed on every path.

Probe: after the sync, fixed sequences are scored teacher-forced by every synced engine and by the
trainer (`probe.py`); `SyncReport.max_abs_logprob_diff` / `mean_abs_logprob_diff`, and a mean above
`probe_threshold` raises `WeightSyncError`. An engine that cannot answer the probe (it died after its
sync) is taken out of service like one whose sync failed; a probe no engine answers raises.

Peak extra memory on a sender is one bucket plus the parameter being gathered.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import gc
import io
import os
import threading
import time
import uuid
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_flash.hf.io import stage_hf_tensors
from megatron_flash.ports import free_ports
from megatron_flash.weight_sync import probe as probe_lib
from megatron_flash.engines.process_group import destroy_weight_update_group, new_weight_update_group

TRANSPORTS = ("ipc", "broadcast", "disk")


class WeightSyncError(RuntimeError):
    """A sync that did not complete; the message names the engine(s) and the step. `report` is the
    SyncReport when the sync got that far (engines out of service, probe numbers)."""

    def __init__(self, message: str, *, report: Optional["SyncReport"] = None) -> None:
        super().__init__(message)
        self.report = report


def hf_buckets(policy: Any, *, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """This PP stage's HF tensors in buckets (non-empty only on the stage's sender; every TP rank
    of the stage must exhaust the iterator because it drives the TP all-gathers).

    Every tensor is copied into its own fresh storage. Without the copy a replicated parameter (a
    norm weight) or a view (q/k/v of one fused tensor) would be sent as the trainer's own storage:
    ipc moves that storage into a shared-memory file for good, and when an engine that opened the
    file dies, torch's shm manager unlinks the name, so every later send of it fails on every engine."""
    layout = policy.layout
    sender = layout.tp_rank == 0 and layout.dp_rank == 0
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in stage_hf_tensors(policy.model, spec=policy.spec, layout=layout):
        if not sender:
            continue
        tensor = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor.detach())
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


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


class WeightBridge:
    """Owns the engine connections of one trainer job; `sync(version)` is called on every rank.

    `on_bucket(index)` (tests) is called on each sender after bucket `index` of a pass went out.
    """

    def __init__(self, policy: Any, engine_urls: Sequence[str], *, transport: str = "ipc", bucket_mb: float = 512,
                 pause_mode: str = "retract", api_key: Optional[str] = None, disk_dir: str = "",
                 master_address: str = "127.0.0.1", timeout_s: float = 600.0, engine_tp_size: int = 1,
                 max_resync: int = 1, fail_fast: bool = False, probe: bool = True, probe_threshold: float = 0.05,
                 alive_timeout_s: float = 10.0, on_bucket: Optional[Callable[[int], None]] = None,
                 colocate: bool = False) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"weight_sync.transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if transport == "disk" and not disk_dir:
            raise ValueError("weight_sync transport 'disk' needs a shared directory (disk_dir)")
        if bucket_mb <= 0:
            raise ValueError(f"weight_sync.bucket_mb must be > 0, got {bucket_mb!r}")
        if max_resync < 0:
            raise ValueError(f"weight_sync.max_resync must be >= 0, got {max_resync!r}")
        if probe_threshold <= 0:
            raise ValueError(f"weight_sync.probe_threshold must be > 0, got {probe_threshold!r}")
        if engine_tp_size < 1:
            raise ValueError(f"engine_tp_size must be >= 1, got {engine_tp_size!r}")
        self.policy, self.urls, self.transport = policy, [u.rstrip("/") for u in engine_urls], transport
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.pause_mode, self.api_key, self.disk_dir = pause_mode, api_key, disk_dir
        self.master_address, self.timeout_s, self.engine_tp_size = master_address, timeout_s, engine_tp_size
        self.max_resync, self.fail_fast = max_resync, fail_fast
        self.probe_enabled, self.probe_threshold, self.alive_timeout_s = probe, probe_threshold, alive_timeout_s
        self.on_bucket = on_bucket
        self.failed: dict[str, str] = {}
        """Engines taken out of service by earlier syncs: url → why."""
        self.colocate = colocate
        self._released: dict[str, set[str]] = {}  # colocated engines' released memory tags (rank 0 knows)
        layout = policy.layout
        self.rank0 = layout.rank == 0
        self._group: Optional[tuple[tuple[str, ...], str, Any]] = None  # this stage's (members, name, group)

    @classmethod
    def from_config(cls, policy: Any, engine_urls: Sequence[str], config: Any, **kwargs: Any) -> "WeightBridge":
        """From a `WeightSyncConfig`; `kwargs` carry what lives elsewhere (pause_mode, api_key, disk_dir…)."""
        return cls(policy, engine_urls, transport=config.transport, bucket_mb=config.bucket_mb,
                   max_resync=config.max_resync, fail_fast=config.fail_fast, probe=config.probe,
                   probe_threshold=config.probe_threshold, **kwargs)

    # ------------------------------------------------------------------ collectives
    def _bcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _merge(self, errors: dict[str, str]) -> dict[str, str]:
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, errors)
        merged: dict[str, str] = {}
        for part in parts:
            for url, message in part.items():
                merged.setdefault(url, message)
        return merged

    # ------------------------------------------------------------------ HTTP (rank 0 and senders)
    def _fan(self, step: str, urls: Sequence[str], call: Callable[[Any], Any], *, session: bool = False,
             timeout_s: Optional[float] = None, retries: int = 3) -> tuple[dict[str, Any], dict[str, str]]:
        """`call(client)` on every url concurrently → (results, errors as 'step: message')."""
        from megatron_flash.engines.client import EngineClient

        timeout = timeout_s or self.timeout_s

        async def one(url: str) -> Any:
            # Begin/end are explicit calls here ("always"); updates are never wrapped again ("never").
            async with EngineClient(url, api_key=self.api_key, request_timeout_s=timeout, control_timeout_s=timeout,
                                    max_retries=retries, weight_update_session="always" if session else "never") as c:
                return await call(c)

        async def every() -> list[Any]:
            return await asyncio.gather(*(one(u) for u in urls), return_exceptions=True)

        results: dict[str, Any] = {}
        errors: dict[str, str] = {}
        for url, out in zip(urls, asyncio.run(every()) if urls else []):
            if isinstance(out, BaseException):
                errors[url] = f"{step}: {type(out).__name__}: {out}"
            else:
                results[url] = out
        return results, errors

    def _alive(self, urls: Sequence[str]) -> list[str]:
        """Engines that still answer (rank 0 asks, everyone learns). /health is not used: SGLang answers
        503 there after ~20 s paused, and a dirty engine is paused."""
        alive = []
        if self.rank0:
            results, _ = self._fan("alive", urls, lambda c: c.get_weight_version(), timeout_s=self.alive_timeout_s,
                                   retries=0)
            alive = [u for u in urls if u in results]
        return self._bcast(alive)

    def release_memory(self) -> dict[str, str]:
        """Colocated mode, before training: pause (abort) every engine in service and release its memory
        (weights, KV cache, CUDA graphs). An engine that cannot is taken out of service (it would hold
        device memory the trainer needs). Collective; returns url → error."""
        errors: dict[str, str] = {}
        if self.rank0:
            _, errors = self._fan("pause_generation", self.urls, lambda c: c.pause_generation("abort"))
            ok = [u for u in self.urls if u not in errors]
            _, more = self._fan("release_memory_occupation", ok, lambda c: c.release_memory_occupation())
            errors.update(more)
            for url in ok:
                if url not in more:
                    self._released[url] = {"weights", "kv_cache", "cuda_graph"}
        errors = self._bcast(errors)
        for url, why in errors.items():
            self.urls.remove(url)
            self.failed[url] = why
        return errors

    def _resume_memory(self, urls: Sequence[str], tags: list[str], step: str) -> dict[str, str]:
        """Rank 0: take back `tags` (those still released) on `urls`; returns url → error."""
        todo = {u: [t for t in tags if t in self._released.get(u, ())] for u in urls}
        todo = {u: t for u, t in todo.items() if t}
        results, errors = self._fan(step, list(todo), lambda c: c.resume_memory_occupation(todo[c.url]))
        for url in results:
            self._released[url].difference_update(todo[url])
            if not self._released[url]:
                del self._released[url]
        return errors

    def readmit(self, urls: Sequence[str]) -> None:
        """Put engines (restarted by the launcher) back among the targets of the next sync, which
        sends them every weight. Every rank must call it with the same list."""
        urls = [u.rstrip("/") for u in urls]
        if self._group is not None and any(u in self._group[0] for u in urls):
            self._drop_group()  # a restarted process is not in the old broadcast group: form a new one
        for url in urls:
            self.failed.pop(url, None)
            self._released.pop(url, None)  # a new process holds its memory
            if url not in self.urls:
                self.urls.append(url)

    # ------------------------------------------------------------------ protocol
    def sync(self, version: int) -> SyncReport:
        """Push the current weights as `version` to every engine in service. Collective: all ranks."""
        t0 = time.perf_counter()
        targets = list(self.urls)
        if not targets:
            raise WeightSyncError(f"weight sync to version {version}: no engine in service "
                                  f"(out of service: {self.failed or 'none'})")
        if self.transport == "disk":
            self.policy.export_hf(self.disk_dir)
        errors, sent, buckets = self._pass(version, targets)
        first_errors = dict(errors)
        resynced: list[str] = []
        for attempt in range(self.max_resync):
            retry = self._alive(sorted(errors)) if errors else []
            if not retry:
                break
            again, s, b = self._pass(version, retry, resync=True)
            sent, buckets = sent + s, buckets + b
            for url in retry:
                if url in again:
                    errors[url] = f"{errors[url]}; re-sync {attempt + 1}: {again[url]}"
                else:
                    errors.pop(url)
                    resynced.append(url)
        for url in errors:
            self.urls.remove(url)
            self.failed[url] = errors[url]
        all_errors = {u: (errors[u] if u in errors else f"{first_errors[u]} (re-synced)") for u in first_errors}
        report = SyncReport(version=version, seconds=0.0, bytes_sent=sent, num_buckets=buckets,
                            transport=self.transport, synced_urls=[u for u in targets if u not in errors],
                            failed_urls=[u for u in targets if u in errors], resynced_urls=resynced,
                            errors=all_errors)
        if errors and (self.fail_fast or not report.synced_urls):
            report.seconds = time.perf_counter() - t0
            detail = "; ".join(f"{u}: {m}" for u, m in errors.items())
            raise WeightSyncError(f"weight sync to version {version}: engine(s) taken out of service: {detail}",
                                  report=report)
        if self.probe_enabled:
            t1 = time.perf_counter()
            report.max_abs_logprob_diff, report.mean_abs_logprob_diff, worst, lost = self.probe(report.synced_urls)
            report.probe_seconds = time.perf_counter() - t1
            for url, message in lost.items():  # died between its sync and the probe: out, like a failed sync
                self.urls.remove(url)
                self.failed[url] = f"post-sync probe: {message}"
                report.synced_urls.remove(url)
                report.failed_urls.append(url)
                report.errors[url] = self.failed[url]
            if lost and self.fail_fast:
                report.seconds = time.perf_counter() - t0
                raise WeightSyncError(f"weight sync to version {version}: engine(s) taken out of service: "
                                      + "; ".join(f"{u}: {m}" for u, m in report.errors.items()), report=report)
            if report.mean_abs_logprob_diff > self.probe_threshold:
                report.seconds = time.perf_counter() - t0
                raise WeightSyncError(
                    f"weight sync to version {version}: post-sync probe failed on {worst}: mean |Δ logprob| "
                    f"{report.mean_abs_logprob_diff:.4g} (max {report.max_abs_logprob_diff:.4g}) > probe_threshold "
                    f"{self.probe_threshold:g}: the engine does not serve the trainer's weights", report=report)
        report.seconds = time.perf_counter() - t0
        return report

    def _pass(self, version: int, targets: list[str], *, resync: bool = False) -> tuple[dict[str, str], int, int]:
        """One attempt to bring `targets` to `version`. Collective. Returns (errors, bytes, buckets)."""
        tensor_path = self.transport != "disk"
        errors: dict[str, str] = {}
        if self.rank0:
            _, errors = self._fan("pause_generation", targets, lambda c: c.pause_generation(self.pause_mode))
            if self.colocate:  # the weights' memory first (values arrive with this pass), KV after it
                errors.update(self._resume_memory([u for u in targets if u not in errors], ["weights"],
                                                  "resume_memory_occupation(weights)"))
            if tensor_path and resync:  # a session left open (by the failed pass, or a crashed trainer) blocks begin
                self._fan("end_weight_update", [u for u in targets if u not in errors],
                          lambda c: c.end_weight_update(), session=True, retries=0)
            if tensor_path:
                _, begin = self._fan("begin_weight_update", [u for u in targets if u not in errors],
                                     lambda c: c.begin_weight_update(), session=True)
                errors.update(begin)
        errors = self._bcast(errors)
        active = [u for u in targets if u not in errors]
        local: dict[str, str] = {}
        sent = buckets = 0
        if active and tensor_path:
            local, sent, buckets = self._transfer(active)
        elif active and self.rank0:
            _, local = self._fan("update_weights_from_disk", active, lambda c: c.update_weights_from_disk(
                self.disk_dir, weight_version=str(version), flush_cache=False))
        errors.update(self._merge(local))
        if self.rank0:
            errors.update(self._finish(version, active, errors, tensor_path=tensor_path))
        errors = self._bcast(errors)
        # NCCL (the default group on GPU trainers) reduces CUDA tensors only.
        on_gpu = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        totals = torch.tensor([sent, buckets], dtype=torch.long, device=device)
        dist.all_reduce(totals)
        return errors, int(totals[0]), int(totals[1])

    def _finish(self, version: int, active: list[str], errors: dict[str, str], *, tensor_path: bool) -> dict[str, str]:
        """Rank 0, after the transfer: set the version on the engines that got everything, close, resume."""
        new: dict[str, str] = {}

        def ok() -> list[str]:
            return [u for u in active if u not in errors and u not in new]

        if tensor_path:
            _, e = self._fan("update_weight_version", ok(), lambda c: c.update_weight_version(str(version)))
            new.update(e)
            _, e = self._fan("end_weight_update", active, lambda c: c.end_weight_update(), session=True)
            new.update({u: m for u, m in e.items() if u in ok()})  # a dirty engine's failed end is no news
        if self.pause_mode != "in_place":
            new.update(self._fan("flush_cache", ok(), lambda c: c.flush_cache())[1])
        if self.colocate:
            new.update(self._resume_memory(ok(), ["kv_cache", "cuda_graph"], "resume_memory_occupation(kv_cache)"))
        new.update(self._fan("continue_generation", ok(), lambda c: c.continue_generation())[1])
        versions, e = self._fan("get_weight_version", ok(), lambda c: c.get_weight_version())
        new.update(e)
        new.update({u: f"read back: reports weight_version {v!r}, expected {str(version)!r}"
                    for u, v in versions.items() if v != str(version)})
        return new

    def _transfer(self, active: list[str]) -> tuple[dict[str, str], int, int]:
        """Every rank: drive this stage's buckets; senders push them. Returns this rank's errors."""
        layout = self.policy.layout
        errors: dict[str, str] = {}
        sent = count = 0
        serial = self.transport == "broadcast" and layout.pp_size > 1
        for stage in range(layout.pp_size):
            if stage == layout.pp_rank:
                for index, bucket in enumerate(hf_buckets(self.policy, bucket_bytes=self.bucket_bytes)):
                    live = [u for u in active if u not in errors]
                    step = f"PP stage {stage} bucket {index}"
                    try:
                        if live:
                            send = self._send_ipc if self.transport == "ipc" else self._send_broadcast
                            errors.update(send(bucket, live, step))
                        sent += sum(t.numel() * t.element_size() for _, t in bucket)
                        count += 1
                        if self.on_bucket is not None:
                            self.on_bucket(index)
                    except Exception as error:  # a trainer-side failure: every engine may be partial
                        errors.update({u: f"{step}: trainer rank {layout.rank}: {type(error).__name__}: {error}"
                                       for u in live if u not in errors})
                    del bucket  # keeps peak memory at one bucket (ipc: the engines answered, files can go)
            if serial:
                dist.barrier()
        return errors, sent, count

    # ------------------------------------------------------------------ transports
    def _send_ipc(self, bucket: list[tuple[str, torch.Tensor]], urls: list[str], step: str) -> dict[str, str]:
        import torch.multiprocessing as mp
        from multiprocessing.reduction import ForkingPickler

        mp.set_sharing_strategy("file_system")  # file_descriptor sharing crashes SGLang's scheduler
        buf = io.BytesIO()
        ForkingPickler(buf).dump(bucket)
        payload = [base64.b64encode(buf.getvalue()).decode()] * self.engine_tp_size
        # `bucket` stays referenced until every engine answered: the shared-memory files live until then.
        return self._fan(f"{step} (update_weights_from_tensor)", urls, lambda c: c.update_weights_from_tensor(
            payload, load_format=None, flush_cache=False, weight_version=None))[1]

    def _stage_group(self, urls: list[str]) -> tuple[str, Any]:
        """This stage's group with exactly `urls`; a group with other members is torn down first."""
        members = tuple(urls)
        if self._group is not None and self._group[0] == members:
            return self._group[1], self._group[2]
        self._drop_group()
        name = f"mf_weights_pp{self.policy.layout.pp_rank}_{uuid.uuid4().hex[:8]}"
        port = free_ports(1)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        world = 1 + len(urls) * self.engine_tp_size
        joins: dict[str, Any] = {}

        def engines_join() -> None:
            offsets = {u: 1 + i * self.engine_tp_size for i, u in enumerate(urls)}
            joins.update(self._fan("init_weights_update_group", urls, lambda c: c.init_weights_update_group(
                master_address=self.master_address, master_port=port, rank_offset=offsets[c.url], world_size=world,
                group_name=name, backend=backend))[1])

        thread = threading.Thread(target=engines_join, daemon=True)
        thread.start()
        group = new_weight_update_group(master_address=self.master_address, master_port=port, rank=0,
                                        world_size=world, group_name=name, backend=backend, timeout_s=self.timeout_s)
        thread.join(self.timeout_s)
        if joins or thread.is_alive():
            destroy_weight_update_group(group)
            raise RuntimeError(f"could not form update group {name}: {joins or 'timeout'}")
        self._group = (members, name, group)
        return name, group

    def _drop_group(self) -> None:
        """Tear down this stage's group on our side and (best effort) on engines still in service."""
        if self._group is None:
            return
        members, name, group = self._group
        self._group = None
        destroy_weight_update_group(group)
        del group
        gc.collect()  # the last reference gone, our connections close: blocked engines' receives fail now
        live = [u for u in members if u in self.urls]
        self._fan("destroy_weights_update_group", live, lambda c: c.destroy_weights_update_group(name),
                  timeout_s=self.alive_timeout_s, retries=0)

    def _send_broadcast(self, bucket: list[tuple[str, torch.Tensor]], urls: list[str], step: str) -> dict[str, str]:
        try:
            name, group = self._stage_group(urls)
        except Exception as error:
            return {u: f"{step}: {error}" for u in urls}
        body = dict(names=[n for n, _ in bucket], dtypes=[str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    shapes=[list(t.shape) for _, t in bucket], group_name=name, flush_cache=False, weight_version=None)
        announced: dict[str, str] = {}

        def announce() -> None:
            announced.update(self._fan(f"{step} (update_weights_from_distributed)", urls,
                                       lambda c: c.update_weights_from_distributed(**body))[1])

        thread = threading.Thread(target=announce, daemon=True)
        thread.start()
        failure = ""
        try:
            for _, tensor in bucket:
                dist.broadcast(tensor, group=group, group_src=0)
        except Exception as error:  # a member died mid-collective: the group is unusable for all
            failure = f"{step} (broadcast): {type(error).__name__}: {error}"
        del group  # outside the except block: no traceback frame keeps the group alive either
        if failure:
            self._drop_group()  # closes our connections, so the survivors' receives fail now
            thread.join(self.timeout_s)
            return {u: announced.get(u, failure) for u in urls}
        thread.join(self.timeout_s)
        if thread.is_alive():
            announced.update({u: f"{step}: no answer within {self.timeout_s:g}s" for u in urls})
        if announced:
            self._drop_group()
            return {u: announced.get(u, f"{step}: another member of group {name} failed") for u in urls}
        return {}

    # ------------------------------------------------------------------ probe
    def probe(self, urls: Sequence[str]) -> tuple[float, float, str, dict[str, str]]:
        """Teacher-forced logprobs of fixed sequences: trainer (all ranks) vs every engine in `urls`
        (rank 0). Returns (max, mean, worst url, {url: error} of engines that could not answer), the
        same on every rank; raises when none answered. Collective."""
        tokens = probe_lib.probe_tokens(self.policy.spec.vocab_size)
        trainer, _ = self.policy.compute_logprobs({"tokens": tokens})
        result: Any = None
        if self.rank0:
            async def every() -> list[Any]:
                return await asyncio.gather(*(probe_lib.engine_logprobs(
                    u, tokens, probe_lib.PROMPT_LEN, api_key=self.api_key, timeout_s=self.timeout_s) for u in urls),
                    return_exceptions=True)
            try:
                worst, lost = (-1.0, -1.0, ""), {}
                for url, out in zip(urls, asyncio.run(every())):
                    if isinstance(out, Exception):  # e.g. the engine died after its sync
                        lost[url] = f"{type(out).__name__}: {out}"
                        continue
                    if isinstance(out, BaseException):
                        raise out
                    mx, mean = probe_lib.logprob_diffs(trainer, out, probe_lib.PROMPT_LEN)
                    worst = max(worst, (mean, mx, url))
                if len(lost) == len(urls):
                    raise WeightSyncError("no engine answered: " + "; ".join(f"{u}: {m}" for u, m in lost.items()))
                result = (worst[1], worst[0], worst[2], lost)
            except Exception as error:
                result = f"post-sync probe could not run: {type(error).__name__}: {error}"
        result = self._bcast(result)
        if isinstance(result, str):
            raise WeightSyncError(result)
        return result


def default_disk_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "weights_for_engines")
