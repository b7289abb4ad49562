"""Parallel layouts: a rank's place in the TP × PP × DP (× EP) grid (`Layout`, filled in by the trainer
when it joins its process groups), and tensor-parallel sharding: HF tensors → one rank's Megatron
shard, and all shards → HF tensors.

Pure torch; the layouts are the ones tabled in `name_maps.py`. Reads go through a `TensorReader`
that can return a row or column slice, so loading a shard touches only the bytes that shard needs
(safetensors slices are lazy).

Worked example, GQA with 4 query heads, 2 groups, head_dim d, TP = 2: rank 1 owns group 1, i.e.
q heads 2–3 (q_proj rows 2d…4d), k_proj rows d…2d and v_proj rows d…2d, stacked as [q; k; v].
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol, Sequence

import torch

from megatron_flash.hf.spec import HFModelSpec
from megatron_flash.hf.name_maps import Rule


@dataclasses.dataclass(frozen=True)
class Layout:
    world_size: int
    rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep_size: int = 1
    """Expert parallel: the experts of each MoE layer are split over this many ranks."""
    ep_rank: int = 0
    etp_size: int = 1
    """Expert tensor parallel: each expert's weights are split over this many ranks."""
    etp_rank: int = 0
    edp_rank: int = 0
    """Rank among the replicas of this rank's experts (expert data parallel)."""
    cp_size: int = 1
    """Context parallel: each sequence is split over this many ranks (weights are replicated)."""
    cp_rank: int = 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


class TensorReader(Protocol):
    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, rows: Optional[slice] = None, cols: Optional[slice] = None) -> torch.Tensor: ...


class DictReader:
    """A TensorReader over in-memory tensors (tests, weight sync)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name: str, rows: Optional[slice] = None, cols: Optional[slice] = None) -> torch.Tensor:
        t = self.tensors[name]
        if rows is not None:
            t = t[rows]
        if cols is not None:
            t = t[:, cols]
        return t


def _part(n: int, tp_rank: int, tp_size: int) -> slice:
    assert n % tp_size == 0, (n, tp_size)
    size = n // tp_size
    return slice(tp_rank * size, (tp_rank + 1) * size)


def hf_to_shard(
    rule: Rule,
    names: Sequence[str],
    reader: TensorReader,
    *,
    spec: HFModelSpec,
    tp_rank: int,
    tp_size: int,
    padded_vocab_size: int,
) -> torch.Tensor:
    layout = rule.layout
    if layout == "replicated":
        return reader.read(names[0])
    if layout == "column":
        return reader.read(names[0], rows=_part(reader.shape(names[0])[0], tp_rank, tp_size))
    if layout == "row":
        return reader.read(names[0], cols=_part(reader.shape(names[0])[1], tp_rank, tp_size))
    if layout == "vocab":
        rows = _part(padded_vocab_size, tp_rank, tp_size)
        vocab = reader.shape(names[0])[0]
        real = reader.read(names[0], rows=slice(rows.start, min(rows.stop, vocab)))
        pad = rows.stop - rows.start - real.shape[0]
        if pad > 0:  # padded vocabulary rows never score: logprobs mask them (see logprobs.py)
            real = torch.cat([real, real.new_zeros((pad,) + tuple(real.shape[1:]))])
        return real
    if layout == "gate_up":
        n = reader.shape(names[0])[0]
        return torch.cat([reader.read(names[0], rows=_part(n, tp_rank, tp_size)),
                          reader.read(names[1], rows=_part(n, tp_rank, tp_size))])
    if layout == "qkv":
        d, hpg = spec.head_dim, spec.heads_per_group
        groups = _part(spec.num_query_groups, tp_rank, tp_size)
        q = reader.read(names[0], rows=slice(groups.start * hpg * d, groups.stop * hpg * d))
        k = reader.read(names[1], rows=slice(groups.start * d, groups.stop * d))
        v = reader.read(names[2], rows=slice(groups.start * d, groups.stop * d))
        num = groups.stop - groups.start
        rest = tuple(q.shape[1:])
        stacked = torch.cat(
            [q.reshape((num, hpg * d) + rest), k.reshape((num, d) + rest), v.reshape((num, d) + rest)], dim=1
        )
        return stacked.reshape((num * (hpg + 2) * d,) + rest)
    raise AssertionError(layout)


def shards_to_hf(
    rule: Rule,
    names: Sequence[str],
    shards: Sequence[torch.Tensor],
    *,
    spec: HFModelSpec,
) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_shard` given every TP rank's shard, in rank order. With one shard (TP1) the
    results may be views of it (no copy where none is needed): a caller that keeps them copies."""

    def cat(parts: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=dim)

    layout = rule.layout
    if layout == "replicated":
        return {names[0]: shards[0]}
    if layout == "column":
        return {names[0]: cat(shards)}
    if layout == "row":
        return {names[0]: cat(shards, dim=1)}
    if layout == "vocab":
        return {names[0]: cat(shards)[: spec.vocab_size]}
    if layout == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return {names[0]: cat([h[0] for h in halves]), names[1]: cat([h[1] for h in halves])}
    if layout == "qkv":
        d, hpg = spec.head_dim, spec.heads_per_group
        full = cat(shards)
        rest = tuple(full.shape[1:])
        grouped = full.reshape((spec.num_query_groups, (hpg + 2) * d) + rest)
        q, k, v = grouped.split([hpg * d, d, d], dim=1)
        return {
            names[0]: q.reshape((-1,) + rest),
            names[1]: k.reshape((-1,) + rest),
            names[2]: v.reshape((-1,) + rest),
        }
    raise AssertionError(layout)
