"""ipc: weights move through memory the trainer's host shares with the engines.

Two ways, chosen per engine:
  staged    engines that advertise `weight_update_shared_memory` in /get_server_info (the local
            engine): CPU staging in the sender's persistent shared buffers, two filled and read
            alternately, mapped once by each engine (shared_buffers.py). A new buffer set is made
            when the engine set changes (an engine lost or readmitted); the old one is freed.
  pickled   every other engine (SGLang): each bucket flattened into one host tensor per dtype
            (SGLang's `flattened_bucket` load format), pickled with torch's ForkingPickler (a
            shared-memory file with the `file_system` strategy) and POSTed to
            /update_weights_from_tensor, one copy of the payload per engine TP rank.
"""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace
from typing import ClassVar, Optional, Sequence

import torch

from megatron_flash.weight_sync.calls import Errors
from megatron_flash.weight_sync.plan import Bucket
from megatron_flash.weight_sync.transports.base import StreamingTransport, TransportContext
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
        self._stager: Optional[Stager] = None
        self._engine_set: frozenset[str] = frozenset()

    def prepare(self, version: int) -> None:
        engines = frozenset(self.ctx.in_service())
        if self._stager is not None and engines != self._engine_set:
            self._close_stager()  # an engine lost or added: new buffers for the new set
        self._engine_set = engines

    def send(self, bucket: Bucket, urls: list[str], step: str) -> Errors:
        staged = [u for u in urls if self._takes_staged(u)]
        pickled = [u for u in urls if u not in staged]
        errors: Errors = {}
        if staged:
            errors.update(self._stager_for().add(bucket, staged, step))
        if pickled:
            errors.update(self._send_pickled(bucket, pickled, step))
        return errors

    def drain(self) -> Errors:
        return self._stager.drain() if self._stager is not None else {}

    def forget(self, urls: Sequence[str]) -> None:
        for url in urls:
            self._staged.pop(url, None)
        self._close_stager()

    def close(self) -> None:
        self._close_stager()

    # -------------------------------------------------------------- staged
    def _takes_staged(self, url: str) -> bool:
        if url not in self._staged:
            infos, _ = self.ctx.calls.fan("get_server_info", [url], lambda c: c.server_info(), retries=1)
            self._staged[url] = bool(infos.get(url, {}).get(STAGED_FLAG))  # unknown → pickled, never wrong
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


def flatten_by_dtype(bucket: Bucket, *, shared: bool = False) -> list[tuple[torch.Tensor, list[SimpleNamespace]]]:
    """SGLang's `flattened_bucket` load format: per dtype, one uint8 tensor holding the bucket's tensors of
    that dtype back to back, and per tensor (name, shape, dtype, start_idx, end_idx, numel) in bytes.

    One tensor per dtype means one shared-memory file per bucket (what one CUDA IPC handle would carry) instead of
    one per tensor, and no byte offset is ever misaligned for its dtype. The flat tensor is a private
    host copy: ForkingPickler moves a CPU storage into a shared-memory file for good, and an engine that
    opened the file and died takes its name with it (a later send of the same storage would fail).
    `shared`: the flat tensor is allocated in shared memory of the current sharing strategy, so that
    pickling it copies nothing more (one copy of the bucket instead of two, and no private pages).
    The metadata are SimpleNamespaces, which SGLang's (and the local engine's) safe unpickler admit and
    read by attribute, so the trainer needs no SGLang import."""
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in bucket:
        by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
    out = []
    for dtype, named in by_dtype.items():
        nbytes = sum(t.numel() for _, t in named) * dtype.itemsize
        flat = torch.empty(0 if shared else nbytes, dtype=torch.uint8)
        if shared:
            flat.set_(torch.UntypedStorage._new_shared(nbytes))
        metadata, offset = [], 0
        for name, tensor in named:
            size = tensor.numel() * dtype.itemsize
            flat[offset:offset + size].view(dtype).view(tensor.shape).copy_(tensor)
            metadata.append(SimpleNamespace(name=name, shape=tensor.shape, dtype=dtype, start_idx=offset,
                                            end_idx=offset + size, numel=size))
            offset += size
        out.append((flat, metadata))
    return out
