"""CUDA tensors in weight payloads whose device is named by UUID (the engine side of the trainer's
CUDA ipc, weight_sync/transports/cuda_ipc.py, and of SGLang's patched torch reductions).

A pickled CUDA tensor carries its storage's device as an index in the *producer's* numbering; the
trainer and an engine may see the GPUs under different CUDA_VISIBLE_DEVICES, so the producer sends the
device's UUID and the engine looks it up among its visible GPUs. A GPU this process cannot see gets a
refusal containing CANNOT_OPEN_CUDA, which the trainer reads as "send this engine host memory".
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import torch

CANNOT_OPEN_CUDA = "cannot open the trainer's CUDA memory"
DEVICE_ARG = 6
"""Index of the storage device in torch's rebuild_cuda_tensor arguments (unchanged for years; SGLang
relies on the same position)."""


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_uuids() -> list[str]:
    return [device_uuid(i) for i in range(torch.cuda.device_count())]


def cuda_index_of(device: Any, uuids: Callable[[], list[str]]) -> int:
    """The local CUDA index of a pickled storage device: an index as is, a UUID looked up in `uuids()`
    (this process's visible GPUs in index order). Raises ValueError with CANNOT_OPEN_CUDA when the UUID
    is not visible here."""
    if isinstance(device, int):
        return device
    if not isinstance(device, str):
        raise ValueError(f"a CUDA tensor's device must be an index or a UUID string, got {device!r}")
    visible = uuids()
    if device not in visible:
        raise ValueError(f"{CANNOT_OPEN_CUDA}: its GPU {device} is not visible to this engine "
                         f"({len(visible)} visible GPU(s)); the trainer sends host memory instead")
    return visible.index(device)


HANDLE_ARG, OFFSET_ARG = 7, 9
"""Indices of the storage's IPC handle and its byte offset in rebuild_cuda_tensor's arguments."""
MAX_MAPPED = 8
_mapped: "collections.OrderedDict[tuple, Any]" = collections.OrderedDict()


def rebuild_cuda_tensor_by_uuid(*args: Any) -> torch.Tensor:
    """torch's rebuild_cuda_tensor for payloads whose device is a UUID (dumps_with_device_uuids, SGLang).

    The storages of the last MAX_MAPPED handles stay referenced here. The trainer sends its persistent
    flat buffers again and again, and torch reuses a mapping it still holds (its `shared_cache`, keyed
    by handle and offset) instead of opening the handle again, a cudaIpcOpenMemHandle of a few ms per
    bucket. A reused mapping skips the producer's IPC event, so the trainer synchronizes its copies
    into a buffer before it sends it (weight_sync/transports/ipc.py)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index = cuda_index_of(args[DEVICE_ARG], visible_uuids)
    tensor = rebuild_cuda_tensor(*args[:DEVICE_ARG], index, *args[DEVICE_ARG + 1:])
    if isinstance(tensor, torch.Tensor) and tensor.is_cuda and args[HANDLE_ARG] is not None:
        key = (args[HANDLE_ARG], args[OFFSET_ARG])
        _mapped[key] = tensor.untyped_storage()
        _mapped.move_to_end(key)
        while len(_mapped) > MAX_MAPPED:
            _mapped.popitem(last=False)
    return tensor


def forget_mappings() -> int:
    """Let go of every kept mapping of the trainer's memory (memory release, shutdown); returns how many."""
    count = len(_mapped)
    _mapped.clear()
    return count
