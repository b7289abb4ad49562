"""SGLang's `flattened_bucket` layout, shared by ipc's host and CUDA paths: per dtype, one uint8 tensor
holding the bucket's tensors of that dtype back to back, and per tensor a SimpleNamespace (name, shape,
dtype, start_idx, end_idx, numel) of byte offsets into it (SGLang's FlattenedTensorMetadata fields)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

Named = list[tuple[str, torch.Tensor]]


def by_dtype(bucket: Named) -> dict[torch.dtype, Named]:
    """The bucket's tensors grouped by dtype, in bucket order (one flat tensor each: no misaligned view)."""
    groups: dict[torch.dtype, Named] = {}
    for name, tensor in bucket:
        groups.setdefault(tensor.dtype, []).append((name, tensor))
    return groups


def nbytes_of(named: Named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def pack(flat: torch.Tensor, named: Named) -> list[SimpleNamespace]:
    """Copy tensors of one dtype into `flat` (uint8, at least nbytes_of(named) long) back to back; their metadata."""
    metadata, offset = [], 0
    for name, tensor in named:
        size = tensor.numel() * tensor.element_size()
        flat[offset:offset + size].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        metadata.append(SimpleNamespace(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=offset,
                                        end_idx=offset + size, numel=size))
        offset += size
    return metadata


def flatten_by_dtype(bucket: Named, *, shared: bool = False) -> list[tuple[torch.Tensor, list[SimpleNamespace]]]:
    """SGLang's `flattened_bucket` load format: per dtype, one uint8 tensor holding the bucket's tensors of
    that dtype back to back, and per tensor (name, shape, dtype, start_idx, end_idx, numel) in bytes.

    The host path's flat tensors (cuda_ipc.py lays a GPU bucket out the same way in device buffers): one
    shared-memory file per bucket and dtype instead of one per tensor. The flat tensor is a private host copy: ForkingPickler moves a CPU storage into a shared-memory file for good, and an engine that
    opened the file and died takes its name with it (a later send of the same storage would fail).
    `shared`: the flat tensor is allocated in shared memory of the current sharing strategy, so that
    pickling it copies nothing more (one copy of the bucket instead of two, and no private pages).
    The metadata are SimpleNamespaces, which SGLang's (and the local engine's) safe unpickler admit and
    read by attribute, so the trainer needs no SGLang import."""
    out = []
    for named in by_dtype(bucket).values():
        flat = torch.empty(0 if shared else nbytes_of(named), dtype=torch.uint8)
        if shared:
            flat.set_(torch.UntypedStorage._new_shared(nbytes_of(named)))
        out.append((flat, pack(flat, named)))
    return out
