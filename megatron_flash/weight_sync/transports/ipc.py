"""ipc: weights move through memory the trainer's host shares with the engines.

Three ways, chosen per engine and bucket:
  cuda      buckets on a GPU, engines on a GPU (`device` in /get_server_info): one CUDA IPC handle
            per bucket and dtype into the trainer's persistent flat device buffers, the device named
            by UUID (cuda_ipc.py). An engine that cannot see the trainer's GPU refuses with
            CANNOT_OPEN_CUDA and gets host memory from then on.
  staged    engines that advertise `weight_update_shared_memory` in /get_server_info (the local
            engine): CPU staging in the sender's persistent shared buffers, two filled and read
            alternately, mapped once by each engine (shared_buffers.py). A new buffer set is made
            when the engine set changes (an engine lost or readmitted); the old one is freed.
  pickled   every other engine (SGLang on the CPU): each bucket flattened into one host tensor per
            dtype (SGLang's `flattened_bucket` load format), pickled with torch's ForkingPickler (a
            shared-memory file with the `file_system` strategy) and POSTed to
            /update_weights_from_tensor, one copy of the payload per engine TP rank.
`paths` records which way each engine got its last bucket.
"""

from __future__ import annotations

import base64
import io
from typing import ClassVar, Optional, Sequence

import torch

from megatron_flash.weight_sync.calls import Errors
from megatron_flash.weight_sync.plan import Bucket
from megatron_flash.weight_sync.transports.base import StreamingTransport, TransportContext
from megatron_flash.weight_sync.transports.cuda_ipc import (
    CANNOT_OPEN_CUDA,
    DeviceFlatBuffers,
    bucket_on_cuda,
    dumps_with_device_uuids,
)
from megatron_flash.weight_sync.transports.flat_bucket import flatten_by_dtype
from megatron_flash.weight_sync.transports.shared_buffers import SharedBuffers, Stager

STAGED_FLAG = "weight_update_shared_memory"
CANNOT_MAP = "ipc needs engines on the trainer's host"
"""In the engine's refusal when it cannot open the trainer's buffer (engines/shared_weights.py)."""


class IpcTransport(StreamingTransport):
    name: ClassVar[str] = "ipc"
    copies_buckets: ClassVar[bool] = True

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self._staged: dict[str, bool] = {}
        """url → the engine takes staged buffers (asked once per engine process)."""
        self._asked: set[str] = set()
        self._cuda: dict[str, bool] = {}
        """url → the engine is on a GPU and opens the trainer's CUDA memory (until it refuses)."""
        self._stager: Optional[Stager] = None
        self._device_buffers: Optional[DeviceFlatBuffers] = None
        self._engine_set: frozenset[str] = frozenset()
        self.paths: dict[str, str] = {}
        """url → "cuda", "staged" or "pickled": how the engine got its last bucket."""

    def prepare(self, version: int) -> None:
        engines = frozenset(self.ctx.in_service())
        if self._stager is not None and engines != self._engine_set:
            self._close_stager()  # an engine lost or added: new buffers for the new set
        self._engine_set = engines

    def send(self, bucket: Bucket, urls: list[str], step: str) -> Errors:
        cuda = [u for u in urls if self._takes_cuda(u)] if bucket_on_cuda(bucket) else []
        staged = [u for u in urls if u not in cuda and self._takes_staged(u)]
        pickled = [u for u in urls if u not in cuda and u not in staged]
        self.paths.update({u: "cuda" for u in cuda} | {u: "staged" for u in staged} | {u: "pickled" for u in pickled})
        errors: Errors = {}
        if cuda:
            errors.update(self._send_cuda(bucket, cuda, step))
        if staged:
            errors.update(self._stager_for().add(bucket, staged, step))
        if pickled:
            errors.update(self._send_pickled(bucket, pickled, step))
        return errors

    def drain(self) -> Errors:
        return self._stager.drain() if self._stager is not None else {}

    def forget(self, urls: Sequence[str]) -> None:
        for url in urls:
            self._asked.discard(url)
            self._staged.pop(url, None)
            self._cuda.pop(url, None)
        self._close_stager()

    def close(self) -> None:
        self._close_stager()
        if self._device_buffers is not None:
            self._device_buffers.close()
            self._device_buffers = None

    def _ask(self, url: str) -> None:
        """What the engine takes, asked once per engine process (unknown → pickled, never wrong)."""
        if url not in self._asked:
            infos, _ = self.ctx.calls.fan("get_server_info", [url], lambda c: c.server_info(), retries=1)
            info = infos.get(url, {})
            self._asked.add(url)
            self._staged.setdefault(url, bool(info.get(STAGED_FLAG)))
            self._cuda.setdefault(url, str(info.get("device", "")).startswith("cuda"))

    # -------------------------------------------------------------- cuda
    def _takes_cuda(self, url: str) -> bool:
        self._ask(url)
        return self._cuda[url]

    def _send_cuda(self, bucket: Bucket, urls: list[str], step: str) -> Errors:
        if self._device_buffers is None:
            self._device_buffers = DeviceFlatBuffers()
        errors: Errors = {}
        tp = self.ctx.engine_tp_size
        regions = self._device_buffers.flatten(bucket)
        # The copies into the buffer finish before any engine reads it: an engine that has this buffer
        # mapped from an earlier bucket reads it without waiting for the IPC event (engines/cuda_handles.py).
        if regions and regions[0][0].is_cuda:
            torch.cuda.current_stream(regions[0][0].device).synchronize()
        for flat, metadata in regions:
            live = [u for u in urls if u not in errors]
            # One pickling per engine and TP rank: each unpickling takes one of the handle's reference counts.
            errors.update(self.ctx.calls.fan(
                f"{step} (update_weights_from_tensor, CUDA ipc)", live,
                lambda c: c.update_weights_from_tensor(
                    [base64.b64encode(dumps_with_device_uuids({"flattened_tensor": flat, "metadata": metadata}))
                     .decode() for _ in range(tp)], load_format="flattened_bucket", flush_cache=False,
                    weight_version=None))[1])
        for url, message in errors.items():
            if CANNOT_OPEN_CUDA in message:  # the trainer's GPU is not visible there: its re-sync goes by host
                self._cuda[url] = False
        return errors

    # -------------------------------------------------------------- staged
    def _takes_staged(self, url: str) -> bool:
        self._ask(url)
        return self._staged[url]

    def _stager_for(self) -> Stager:
        if self._stager is None:
            size = max(4096, min(self.ctx.bucket_bytes, self.ctx.sender_bytes_bound))
            self._stager = Stager(self._deliver, SharedBuffers(size))
        return self._stager

    def _deliver(self, spec: dict, entries: list, urls: list[str], label: str) -> Errors:
        errors = self.ctx.calls.fan(f"{label} (update_weights_from_shared_memory)", urls,
                                    lambda c: c.update_weights_from_shared_memory(spec, entries))[1]
        for url, message in errors.items():
            if CANNOT_MAP in message:  # another host or PID namespace: its re-sync goes pickled
                self._staged[url] = False
        return errors

    def _close_stager(self) -> None:
        stager, self._stager = self._stager, None
        if stager is not None:
            stager.close()

    # -------------------------------------------------------------- pickled
    def _send_pickled(self, bucket: Bucket, urls: list[str], step: str) -> Errors:
        import torch.multiprocessing as mp
        from multiprocessing.reduction import ForkingPickler

        mp.set_sharing_strategy("file_system")  # file_descriptor sharing crashes SGLang's scheduler
        errors: Errors = {}
        for flat, metadata in flatten_by_dtype(bucket, shared=True):
            buf = io.BytesIO()
            ForkingPickler(buf).dump({"flattened_tensor": flat, "metadata": metadata})
            payload = [base64.b64encode(buf.getvalue()).decode()] * self.ctx.engine_tp_size
            live = [u for u in urls if u not in errors]
            # `flat` stays referenced until every engine answered: its shared-memory file lives until then.
            errors.update(self.ctx.calls.fan(f"{step} (update_weights_from_tensor)", live,
                                             lambda c: c.update_weights_from_tensor(
                                                 payload, load_format="flattened_bucket", flush_cache=False,
                                                 weight_version=None))[1])
        return errors
