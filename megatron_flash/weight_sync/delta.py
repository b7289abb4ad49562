"""The sender's side of delta weight sync: the last-pushed engine-dtype copy and the bucket encoder.

Each sender keeps, per HF tensor it sends, the values the engines were last given, in the engines'
dtype (`engines.dtype`), on the device the tensor comes from (a GPU trainer keeps it in GPU memory:
the bf16 size of its share of the model). A push is encoded per bucket in one of three modes:

    plain   the tensors as they are, cast to the engine dtype (engines that take no delta: SGLang)
    full    every tensor whole, each with its checksum (the first push, anchors, re-syncs, rejoins)
    delta   per tensor, the positions whose bits differ from the kept copy and their new values
            (int32 positions, or a bitmask when that is smaller, or zlib of the positions' gaps when
            that saves a fifth more: lossless compression where it pays); a tensor whose share of changed
            values passes `max_density` goes whole; every tensor carries its checksum; every bucket
            names the base version

The wire format and the checksum are in engines/weight_delta.py, which the engines share. The kept
copy is updated in place as each tensor is encoded, so after the first pass of a sync it holds the
new version: the passes after it in the same sync (re-syncs, other engines) are full ones, and a
pass that failed on the trainer's side leaves the copy unusable (`invalidate`: the next sync is full).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import numpy as np
import torch

from megatron_flash.engines.weight_delta import BASE, checksum, compress_positions, int_view, pack_mask, part_name
from megatron_flash.weight_sync.plan import Bucket

MODES = ("plain", "full", "delta")
MIN_COMPRESS = 256
"""Changed values a tensor needs before its positions are tried with zlib (below, the call costs more)."""


@dataclasses.dataclass
class DeltaStats:
    """One pass's encoding on this rank."""

    tensors: int = 0
    elements: int = 0
    changed: int = 0
    """Values whose bits differ from the kept copy (delta mode; a whole tensor counts all its elements)."""
    bytes_full: int = 0
    """What the pass would carry as whole tensors in the engine dtype."""
    whole: int = 0
    """Tensors sent whole in delta mode (dense change, or not in the copy)."""
    compressed: int = 0
    """Tensors whose positions went zlib-compressed (`N::mf.zidx`)."""
    seconds: float = 0.0
    """Encoding time (cast, compare, gather, checksum)."""


class DeltaEncoder:
    def __init__(self, engine_dtype: Optional[torch.dtype], *, max_density: float = 0.5) -> None:
        if not 0 < max_density <= 1:
            raise ValueError(f"weight_sync.delta_max_density must be in (0, 1], got {max_density!r}")
        self.engine_dtype, self.max_density = engine_dtype, max_density
        self.plain_cast = engine_dtype is not None
        """Plain pushes are cast too (engines.dtype was set; else engines cast what they get)."""
        self.copy: dict[str, torch.Tensor] = {}
        self.base_version: Optional[int] = None
        """The version the kept copy holds, None when unusable (no push yet, or a pass failed midway)."""
        self.stats = DeltaStats()

    def copy_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.copy.values())

    def invalidate(self) -> None:
        self.base_version = None

    def commit(self, version: int) -> None:
        self.base_version = version

    def start_pass(self) -> None:
        self.stats = DeltaStats()

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        dtype = self.engine_dtype or tensor.dtype
        return tensor.to(dtype) if tensor.dtype != dtype else tensor

    def encode(self, bucket: Bucket, mode: str, *, base: Optional[int] = None) -> Bucket:
        if mode not in MODES:
            raise ValueError(f"delta mode {mode!r}: one of {', '.join(MODES)}")
        t0 = time.perf_counter()
        out: Bucket = []
        if mode == "delta":
            if base is None or base != self.base_version:
                raise ValueError(f"a delta against version {base} but the kept copy holds {self.base_version}")
            device = bucket[0][1].device if bucket else torch.device("cpu")
            out.append((BASE, torch.tensor([base], dtype=torch.int64, device=device)))
        st = self.stats
        for name, tensor in bucket:
            new = self._cast(tensor) if mode != "plain" or self.plain_cast else tensor
            st.tensors += 1
            st.elements += new.numel()
            st.bytes_full += new.numel() * new.element_size()
            if mode == "plain":
                out.append((name, new))
                continue
            kept = self.copy.get(name)
            if mode == "delta" and kept is not None and kept.shape == new.shape and kept.dtype == new.dtype:
                changed = int_view(kept).view(-1) != int_view(new.contiguous()).view(-1)
                count = int(changed.count_nonzero())  # (a bool sum() is 20× slower on the CPU)
                st.changed += count
                if count == 0:
                    out.append((part_name(name, "sum"), checksum(kept)))
                    continue
                if count <= self.max_density * new.numel():
                    positions = (changed.nonzero().view(-1) if changed.is_cuda  # numpy's is 6× faster on the CPU
                                 else torch.from_numpy(np.flatnonzero(changed.numpy())))
                    values = new.contiguous().view(-1)[positions]
                    kept.view(-1)[positions] = values
                    plain_bytes = min(count * 4, (new.numel() + 7) // 8)
                    packed = compress_positions(positions) if count >= MIN_COMPRESS and new.numel() < 2**31 else b""
                    if packed and len(packed) * 5 <= plain_bytes * 4:  # compression where it pays (a fifth)
                        out.append((part_name(name, "zidx"), torch.frombuffer(bytearray(packed), dtype=torch.uint8)))
                        st.compressed += 1
                    elif count * 4 <= (new.numel() + 7) // 8 or new.numel() >= 2**31:
                        index_dtype = torch.int32 if new.numel() < 2**31 else torch.int64
                        out.append((part_name(name, "idx"), positions.to(index_dtype)))
                    else:
                        out.append((part_name(name, "mask"), pack_mask(changed)))
                    out.append((part_name(name, "val"), values))
                    out.append((part_name(name, "sum"), checksum(kept)))
                    continue
            elif mode == "delta":
                st.changed += new.numel()
            if mode == "delta":
                st.whole += 1
            if kept is not None and kept.shape == new.shape and kept.dtype == new.dtype:
                kept.copy_(new)
            else:
                kept = self.copy[name] = new.detach().clone(memory_format=torch.contiguous_format)
            out.append((name, new))
            out.append((part_name(name, "sum"), checksum(kept)))
        st.seconds += time.perf_counter() - t0
        return out
