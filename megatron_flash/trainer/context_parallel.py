"""Context parallelism (CP) without Transformer Engine: a packed row split over the CP ranks.

Llama 3's recipe. Every sequence of the row (a sample, or the padding tail) is padded to a multiple of
2·CP tokens and cut into 2·CP equal chunks; CP rank r holds chunks r and 2·CP−1−r of every sequence,
so each rank holds a early and a late chunk and causal attention costs every rank about the same:

    sequence of 8 tokens, CP 2 (4 chunks of 2):   chunk  0 1 | 2 3 | 4 5 | 6 7
                                                  rank   0   | 1   | 1   | 0
    rank 0's local row: [0 1 6 7], rank 1's: [2 3 4 5]

Each rank runs the layers on its local row (T/CP tokens). Attention all-gathers K and V over the CP
group (the few KV heads, before GQA's repeat; the backward reduce-scatters dK and dV), and each local
query chunk attends to the keys of its own sequence up to its own end: chunk k of a sequence with
chunks of c tokens has c queries over (k + 1)·c keys, causal from the bottom right (query i sees keys
0 … k·c + i). That is a bottom-right mask with separate query and key offsets, the shape the
shared-prefix plans already have, so the same two core attentions run it (packed_attention.py per
shape with a mask, flash_attention.py with torch's varlen attention and its own key offsets).

RoPE positions are the tokens' own positions in their sequence, passed explicitly as `position_ids`
(trainer/patches/explicit_positions.py). Logprobs are computed for the local tokens (each target is the
next token of the global row: every rank holds the whole batch) and all-gathered back into the global
row, so the loss, every aggregation and their token counts see whole samples on every CP rank (the
gradient of a rank's local logprobs is its slice of the loss's gradient: no reduction). Megatron sums
the token counts over DP × CP; only CP rank 0 reports a micro-batch's count.

Everything here is built on the host from the row's sequence lengths, once per micro-batch.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, Optional, Sequence

import torch

from megatron_flash.trainer.packing import round_up


def chunk_owner(chunk: int, cp_size: int) -> int:
    """The CP rank that holds chunk `chunk` (of 2·cp_size) of a sequence."""
    return chunk if chunk < cp_size else 2 * cp_size - 1 - chunk


def padded(length: int, cp_size: int) -> int:
    """A sequence's length padded to a multiple of 2·CP (an empty one stays empty)."""
    return round_up(length, 2 * cp_size)


@dataclasses.dataclass
class Split:
    """One packed row (sequences of `lengths`, each a multiple of 2·CP) as CP rank `rank` holds it."""

    local_index: torch.Tensor
    """[T / CP] the global row positions this rank holds, in its local order."""
    gather_order: torch.Tensor
    """[T] for each global row position, its index in the CP ranks' local rows concatenated in rank
    order (what an all-gather gives): `gathered[gather_order]` is the global row."""
    local_plan: list
    """[(q_index [sq, b] into the local row, k_index [sk, b] into the gathered keys, bottom-right
    causal mask [sq, sk])], one entry per chunk shape: packed_attention.py's plan."""
    flash_plan: dict
    """cu_q, cu_k (int32), k_index into the gathered keys, max_q, max_k: flash_attention.py's plan."""
    attention_pairs: int
    """(query, key) pairs this rank's attention computes: the balance across ranks."""


def split(lengths: Sequence[int], *, cp_size: int, rank: int) -> Split:
    """How CP rank `rank` holds a row of sequences of `lengths` (each a multiple of 2·CP)."""
    chunks = 2 * cp_size
    for n in lengths:
        if n % chunks:
            raise ValueError(f"a sequence of {n} tokens is not a multiple of 2·CP = {chunks} (pad it first)")
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    per_rank = [_local_positions(lengths, starts, cp_size, r) for r in range(cp_size)]
    local = per_rank[rank]
    width = len(local)
    gather_order = torch.empty(starts[-1], dtype=torch.long)
    for r, positions in enumerate(per_rank):
        gather_order[torch.tensor(positions, dtype=torch.long)] = r * width + torch.arange(width)
    shapes: dict[tuple[int, int], list[tuple[list[int], list[int]]]] = defaultdict(list)
    cu_q, cu_k, k_index, pairs = [0], [0], [], 0
    q_at = 0
    for n, start in zip(lengths, starts):
        if not n:
            continue
        c = n // chunks
        for k in (rank, chunks - 1 - rank):
            queries = list(range(q_at, q_at + c))
            keys = gather_order[start:start + (k + 1) * c].tolist()
            shapes[(c, (k + 1) * c)].append((queries, keys))
            cu_q.append(cu_q[-1] + c)
            cu_k.append(cu_k[-1] + (k + 1) * c)
            k_index += keys
            pairs += c * k * c + c * (c + 1) // 2
            q_at += c
    local_plan = []
    for (sq, sk), members in shapes.items():
        q_index = torch.tensor([q for q, _ in members], dtype=torch.long).T.contiguous()  # [sq, b]
        k_index_b = torch.tensor([k for _, k in members], dtype=torch.long).T.contiguous()  # [sk, b]
        # True = masked: query i (of the last sq) sees keys up to (sk - sq) + i
        mask = torch.arange(sk)[None, :] > (sk - sq) + torch.arange(sq)[:, None]
        local_plan.append((q_index, k_index_b, mask))
    flash = {"cu_q": torch.tensor(cu_q, dtype=torch.int32), "cu_k": torch.tensor(cu_k, dtype=torch.int32),
             "k_index": torch.tensor(k_index, dtype=torch.long),
             "max_q": max((b - a for a, b in zip(cu_q, cu_q[1:])), default=0),
             "max_k": max((b - a for a, b in zip(cu_k, cu_k[1:])), default=0)}
    return Split(local_index=torch.tensor(local, dtype=torch.long), gather_order=gather_order,
                 local_plan=local_plan, flash_plan=flash, attention_pairs=pairs)


def _local_positions(lengths: Sequence[int], starts: Sequence[int], cp_size: int, rank: int) -> list[int]:
    out: list[int] = []
    chunks = 2 * cp_size
    for n, start in zip(lengths, starts):
        c = n // chunks
        for k in (rank, chunks - 1 - rank):
            out += range(start + k * c, start + (k + 1) * c)
    return out


def localize(m: Any, lengths: Sequence[int], *, cp_size: int, cp_rank: int, group: Any, device: torch.device) -> Any:
    """A micro-batch's packed row (sequences of `lengths`, each a multiple of 2·CP) as this CP rank runs
    it: its local tokens and their own positions, the plans over the gathered keys, and what the
    logprobs need to be put back in the row (the whole row's tokens, the gather order)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_flash.trainer import attention_plan

    s = split(lengths, cp_size=cp_size, rank=cp_rank)
    local = s.local_index.to(device)
    cu = s.flash_plan["cu_q"].to(device)  # the local chunks, as THD segments
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s.flash_plan["max_q"],
                             max_seqlen_kv=s.flash_plan["max_q"])
    return dataclasses.replace(
        m, tokens=m.tokens[:, local], positions=m.positions[:, local], row=m.tokens, cp_index=local,
        cp_order=s.gather_order.to(device),
        packed_seq_params=attention_plan.with_plan(params, local_plan=s.local_plan, flash_plan=s.flash_plan,
                                                   device=device, kv_group=group))


class _GatherRow(torch.autograd.Function):
    """All-gather of every CP rank's [1, T/CP, ...] along dim 1; the backward keeps this rank's slice of
    the gradient, unreduced: every rank computes the same loss from the gathered row, so the slice is
    that loss's gradient with respect to this rank's values."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        import torch.distributed as dist

        ctx.rank, ctx.width = dist.get_rank(group), x.shape[1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad[:, ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width].contiguous(), None


def score(scorer: Any, output: torch.Tensor, targets: torch.Tensor, m: Any, group: Any
          ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`scorer(logits, targets)` of a CP micro-batch, put back in the whole row: `output` holds this
    rank's logits [1, T/CP, V_local]; `targets` [1, T − 1(, J)] are the whole row's (position t scores
    token t + 1). Returns the row's logprobs [1, T − 1(, J)] (and entropy [1, T − 1]) on every CP rank."""
    full = torch.cat([targets, targets[:, -1:]], dim=1)  # the row's last position scores nothing
    lp, ent = scorer(output, full[:, m.cp_index])
    lp = _GatherRow.apply(lp, group)[:, m.cp_order][:, :-1]
    if ent is not None:
        ent = _GatherRow.apply(ent, group)[:, m.cp_order][:, :-1]
    return lp, ent


def group() -> Any:
    """Megatron's context-parallel process group."""
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group()


def gather_rows(x: torch.Tensor, m: Any) -> torch.Tensor:
    """[1, T/CP, ...] values of this rank's positions → the whole row's [1, T, ...] (no gradient)."""
    with torch.no_grad():
        return _GatherRow.apply(x, group())[:, m.cp_order]
