"""ipc for buckets that live on a GPU: one CUDA IPC handle per bucket and dtype, device to device.

    trainer GPU tensors ──copy──► persistent flat device buffer (set k % 2) ──pickle: 1 handle──► engine
                                   (per dtype region, aligned)                 device as its UUID   copies into
                                                                                                    its weights
Why flat: pickling each tensor of a bucket as its own CUDA IPC handle makes the engine open (and close)
one mapping per tensor; one flat buffer per dtype costs one mapping per bucket, in SGLang's
`flattened_bucket` load format (the same metadata as the host path, transports/ipc.py).
Why persistent: a new device tensor per bucket means a cudaMalloc (or a caching-allocator block that
then stays pinned by the IPC reference counting until the engine lets go); two buffer sets reused
across syncs, written alternately, cost nothing after the first sync. A set is written again only
after the engines answered the request that used it (the sends are synchronous), and the local engine
synchronizes its copy before it answers.
Why UUIDs: the trainer and the engine may see the GPUs under different CUDA_VISIBLE_DEVICES, so the
pickled device index would name another GPU there. The device goes as its UUID string, as SGLang's
patched reductions expect (`sglang/srt/utils/patch_torch.py`); the local engine maps it back
(engines/cuda_handles.py). An engine that cannot see the trainer's GPU answers with
CANNOT_OPEN_CUDA; the transport then sends it host memory.
Why one payload per engine TP rank: each unpickling takes one of the producer's IPC reference
counts, so a payload shared by several ranks would release the buffer's count more than once.
"""

from __future__ import annotations

import io
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch

from megatron_flash.engines.cuda_handles import CANNOT_OPEN_CUDA, DEVICE_ARG, device_uuid
from megatron_flash.weight_sync.transports.flat_bucket import by_dtype, nbytes_of, pack

__all__ = ["CANNOT_OPEN_CUDA", "DeviceFlatBuffers", "bucket_on_cuda", "dumps_with_device_uuids"]

ALIGN = 256
"""Byte alignment of each dtype's region in a flat buffer (any dtype view of a region is aligned)."""
NUM_SETS = 2


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def bucket_on_cuda(bucket: list[tuple[str, torch.Tensor]]) -> bool:
    return bool(bucket) and all(t.is_cuda for _, t in bucket)


class DeviceFlatBuffers:
    """`NUM_SETS` flat uint8 buffers on the trainer's GPU, each holding one bucket at a time (every dtype
    of it in its own aligned region), used in turn; a buffer grows when a bucket needs more, `close`
    frees them."""

    def __init__(self, num_sets: int = NUM_SETS) -> None:
        if num_sets < 1:
            raise ValueError(f"DeviceFlatBuffers: num_sets must be >= 1, got {num_sets}")
        self._buffers: list[Optional[torch.Tensor]] = [None] * num_sets
        self._next = 0

    def flatten(self, bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[torch.Tensor, list[SimpleNamespace]]]:
        """Copy the bucket into the next buffer: [(flat uint8 view of one dtype's region, metadata)], metadata
        as in flat_bucket.py (byte offsets within that view)."""
        groups = by_dtype(bucket)
        sizes = {dtype: nbytes_of(named) for dtype, named in groups.items()}
        total = sum(_aligned(n) for n in sizes.values())
        device = bucket[0][1].device
        index, self._next = self._next, (self._next + 1) % len(self._buffers)
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < total or buffer.device != device:
            self._buffers[index] = None  # free the old one before the new allocation
            buffer = self._buffers[index] = torch.empty(max(total, ALIGN), dtype=torch.uint8, device=device)
        out, region = [], 0
        for dtype, named in groups.items():
            flat = buffer[region:region + sizes[dtype]]
            out.append((flat, pack(flat, named)))
            region += _aligned(sizes[dtype])
        return out

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers if b is not None)

    def close(self) -> None:
        self._buffers = [None] * len(self._buffers)


def _reduce_with_uuid(tensor: torch.Tensor) -> tuple[Callable, tuple]:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    rebuild, args = reduce_tensor(tensor)
    if rebuild is rebuild_cuda_tensor and isinstance(args[DEVICE_ARG], int):
        args = (*args[:DEVICE_ARG], device_uuid(args[DEVICE_ARG]), *args[DEVICE_ARG + 1:])
    return rebuild, args


def dumps_with_device_uuids(obj: Any) -> bytes:
    """ForkingPickler bytes of `obj` in which every CUDA tensor names its device by UUID (this pickler
    only: torch's global reductions are left as they are)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table[torch.Tensor] = _reduce_with_uuid  # an instance copy of the table
    pickler.dump(obj)
    return buf.getvalue()
