"""Push the trainer's weights to the engines after an optimizer step: plan → execute → transport.

  plan      every PP stage has one *sender* (TP rank 0, DP rank 0); within the stage all TP ranks
            all-gather each parameter (collectives), the sender turns it into HF tensors (name map,
            vocab padding stripped) and groups them into buckets of `bucket_mb`;
  execute   global rank 0 runs the protocol: pause engines → open the weight-update session →
            [every sender streams its buckets] → close the session → flush → continue → every engine
            must report the new weight_version;
  transport ipc        bucket → ForkingPickler payload (shared memory on CPU, `file_system` strategy)
                       → POST /update_weights_from_tensor to every engine
            broadcast  a gloo/NCCL group {sender} ∪ {engine ranks} (single-process trainer only for
                       now, see __init__);
                       POST /update_weights_from_distributed announces names/dtypes/shapes while
                       the sender broadcasts each tensor
            disk       HF safetensors export (atomic) → POST /update_weights_from_disk

Peak extra memory on a sender is one bucket plus the parameter being gathered: the HF tensors of
a bucket are released as soon as it has been sent.

If an engine fails midway it is not silently left half-updated: the protocol raises
`WeightSyncError` naming the engine and the step, after trying to close the session and resume
the others; the caller takes the failed engine out of service (the proxy marks it unhealthy).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import os
import threading
import time
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_flash.trainer.distributed import free_port
from megatron_flash.trainer.hf_io import stage_hf_tensors
from megatron_flash.weight_sync.process_group import new_weight_update_group

TRANSPORTS = ("ipc", "broadcast", "disk")


class WeightSyncError(RuntimeError):
    """A sync that did not complete; the message names the engine and the step."""


def hf_buckets(policy: Any, *, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """This PP stage's HF tensors in buckets (non-empty only on the stage's sender; every TP rank
    of the stage must exhaust the iterator because it drives the TP all-gathers)."""
    layout = policy.layout
    sender = layout.tp_rank == 0 and layout.dp_rank == 0
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in stage_hf_tensors(policy.model, spec=policy.spec, layout=layout):
        if not sender:
            continue
        tensor = tensor.detach().to("cpu").contiguous()
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
    num_buckets: int
    transport: str


class WeightBridge:
    """Owns the engine connections of one trainer job; `sync(version)` is called on every rank."""

    def __init__(self, policy: Any, engine_urls: Sequence[str], *, transport: str = "ipc", bucket_mb: int = 512,
                 pause_mode: str = "retract", api_key: Optional[str] = None, disk_dir: str = "",
                 master_address: str = "127.0.0.1", timeout_s: float = 600.0) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"weight_sync.transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if transport == "broadcast" and policy.layout.world_size > 1:
            # Known gap: with a multi-process trainer (TP2 or PP2 on gloo) forming the update group
            # hangs; until fixed, multi-rank trainers must use ipc or disk.
            raise ValueError("weight_sync.transport=broadcast supports a single-process trainer only in this "
                             "version; use ipc or disk when the trainer has several ranks")
        if transport == "disk" and not disk_dir:
            raise ValueError("weight_sync transport 'disk' needs a shared directory (disk_dir)")
        self.policy, self.urls, self.transport = policy, list(engine_urls), transport
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.pause_mode, self.api_key, self.disk_dir = pause_mode, api_key, disk_dir
        self.master_address, self.timeout_s = master_address, timeout_s
        layout = policy.layout
        self.is_sender = layout.tp_rank == 0 and layout.dp_rank == 0
        self._groups: dict[str, Any] = {}

    # ------------------------------------------------------------------ HTTP helpers (sync facade)
    def _call(self, url: str, method: str, *args: Any, **kwargs: Any) -> Any:
        from megatron_flash.rollout.engine_client import EngineClient

        async def go() -> Any:
            # The protocol opens one begin/end session around all buckets itself: explicit begin/end
            # calls go to the server ("always"), update calls are never wrapped again ("never").
            mode = "always" if method in ("begin_weight_update", "end_weight_update") else "never"
            async with EngineClient(url, api_key=self.api_key, request_timeout_s=self.timeout_s,
                                    control_timeout_s=self.timeout_s, weight_update_session=mode) as client:
                return await getattr(client, method)(*args, **kwargs)

        try:
            return asyncio.run(go())
        except Exception as error:
            raise WeightSyncError(f"weight sync: {method} on engine {url} failed: {error}") from error

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [self._call(url, method, *args, **kwargs) for url in self.urls]

    # ------------------------------------------------------------------ protocol
    def sync(self, version: int) -> SyncReport:
        t0 = time.perf_counter()
        rank0 = self.policy.layout.rank == 0
        error: Optional[BaseException] = None
        if rank0:
            self._all("pause_generation", self.pause_mode)
            if self.transport != "disk":
                self._all("begin_weight_update")
        dist.barrier()
        sent, buckets = 0, 0
        try:
            if self.transport == "disk":
                self.policy.export_hf(self.disk_dir)
                if rank0:
                    self._all("update_weights_from_disk", self.disk_dir, weight_version=str(version))
            else:
                for bucket in hf_buckets(self.policy, bucket_bytes=self.bucket_bytes):
                    (self._send_ipc if self.transport == "ipc" else self._send_broadcast)(bucket, version)
                    sent += sum(t.numel() * t.element_size() for _, t in bucket)
                    buckets += 1
        except BaseException as e:  # finish the protocol on rank 0 before re-raising
            error = e
        failed = torch.tensor([1 if error is not None else 0])
        dist.all_reduce(failed)
        if rank0:
            if self.transport != "disk":
                self._all("end_weight_update")
            if self.pause_mode != "in_place":
                self._all("flush_cache")
            self._all("continue_generation")
            if not failed.item():
                versions = dict(zip(self.urls, self._all("get_weight_version")))
                stale = {u: v for u, v in versions.items() if v != str(version)}
                if stale:
                    raise WeightSyncError(f"weight sync to version {version}: engines report {stale}")
        if error is not None:
            raise error
        if failed.item():
            raise WeightSyncError(f"weight sync to version {version} failed on another rank")
        totals = torch.tensor([sent, buckets], dtype=torch.long)
        dist.all_reduce(totals)
        return SyncReport(version=version, seconds=time.perf_counter() - t0, bytes_sent=int(totals[0]),
                          num_buckets=int(totals[1]), transport=self.transport)

    # ------------------------------------------------------------------ transports
    def _send_ipc(self, bucket: list[tuple[str, torch.Tensor]], version: int) -> None:
        import torch.multiprocessing as mp
        from multiprocessing.reduction import ForkingPickler

        mp.set_sharing_strategy("file_system")  # file_descriptor sharing crashes SGLang's scheduler
        buf = io.BytesIO()
        ForkingPickler(buf).dump(bucket)
        payload = [base64.b64encode(buf.getvalue()).decode()]
        self._all("update_weights_from_tensor", payload, load_format=None, flush_cache=False,
                  weight_version=str(version))
        # `bucket` stays referenced until every engine answered: the shared-memory files live until then.

    def _group_for_stage(self) -> tuple[str, Any]:
        pp_rank = self.policy.layout.pp_rank
        name = f"mf_weights_pp{pp_rank}"
        if name not in self._groups:
            port = free_port()
            world = 1 + len(self.urls)  # one engine rank per engine (engine TP 1 on the CPU path)
            results: list[Any] = []
            threads = []
            for i, url in enumerate(self.urls):
                def join(url: str = url, offset: int = 1 + i) -> None:
                    try:
                        results.append(self._call(url, "init_weights_update_group", master_address=self.master_address,
                                                  master_port=port, rank_offset=offset, world_size=world,
                                                  group_name=name, backend="gloo" if not torch.cuda.is_available() else "nccl"))
                    except BaseException as e:
                        results.append(e)
                thread = threading.Thread(target=join, daemon=True)
                thread.start()
                threads.append(thread)
            group = new_weight_update_group(master_address=self.master_address, master_port=port, rank=0,
                                            world_size=world, group_name=name,
                                            backend="gloo" if not torch.cuda.is_available() else "nccl")
            for thread in threads:
                thread.join(self.timeout_s)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors or len(results) != len(self.urls):
                raise WeightSyncError(f"weight sync: could not form update group {name}: {errors or 'timeout'}")
            self._groups[name] = group
        return name, self._groups[name]

    def _send_broadcast(self, bucket: list[tuple[str, torch.Tensor]], version: int) -> None:
        name, group = self._group_for_stage()
        body = dict(names=[n for n, _ in bucket], dtypes=[str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    shapes=[list(t.shape) for _, t in bucket], group_name=name, flush_cache=False,
                    weight_version=str(version))
        results: list[Any] = []
        threads = []
        for url in self.urls:
            def announce(url: str = url) -> None:
                try:
                    results.append(self._call(url, "update_weights_from_distributed", **body))
                except BaseException as e:
                    results.append(e)
            thread = threading.Thread(target=announce, daemon=True)
            thread.start()
            threads.append(thread)
        for _, tensor in bucket:
            dist.broadcast(tensor, src=0, group=group)
        for thread in threads:
            thread.join(self.timeout_s)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors or len(results) != len(self.urls):
            raise WeightSyncError(f"weight sync (broadcast, group {name}): {errors or 'timeout'}")


def default_disk_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "weights_for_engines")
