"""Shared-prefix packing (trainer.shared_prefix): a group's prompt is computed once for its n responses.

GRPO trains every prompt n times, once in each of its n samples. Here the samples of a group that
share a prompt P (same group, same prompt tokens: checked) become one segment of a packed row:

    row   … | P (once) | R1 | R2 | … | Rn | …          positions 0…|P|-1, then |P|… again for each Ri
    attn  P causal on itself; each Ri on [K_P ; K_Ri], causal from the bottom right (query i of Ri sees
          all of P and Ri's first i+1 tokens): exactly the keys it has in its own unshared row

so every token of every sample sees the same keys at the same RoPE positions as unshared, and the
linears, norms and MLPs run over |P| + Σ|Ri| tokens instead of n·|P| + Σ|Ri|. The prompt's gradient
accumulates from all n responses through autograd. The loss keeps its per-sample view: sample j's
column t comes from the row's prompt (t < |P|) or from Rj (t ≥ |P|); the logprob of Rj's first token
is taken from the last prompt position's logits, which in the row are followed by R1's first token
only, so for j > 1 it is one more (position, target) pair (an *extra*, appended after the row's own).

Units: a group is split into sub-groups that each carry P when it does not fit the token budget or
the micro-batch's sample cap; a unit of one sample is laid out as usual. Attention plans are built
here on the host, once per micro-batch, so the attention layers run them with no host sync:
  local   (packed_attention.py) per shape, index tensors into the row's q/k/v and a bottom-right mask
  flash   (flash_attention.py) cu_seqlens of the queries and of keys gathered per sequence ([P; Ri])
The plans travel with the row's PackedSeqParams as typed fields of a subclass of it (attention_plan.py);
RoPE positions travel as the model's `position_ids` (trainer/patches/explicit_positions.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from typing import Any, Optional, Sequence

import torch

from megatron_flash.trainer import attention_plan
from megatron_flash.trainer.packing import MicroBatch, SampleTooLong, Unit

logger = logging.getLogger(__name__)


def check_shared_prefix(spec: Any, *, enabled: bool, uses_te: bool) -> None:
    """Refuse, by name, what a shared prefix is not exact for."""
    if not enabled:
        return
    if uses_te:
        raise ValueError("trainer.shared_prefix with Transformer Engine's attention: its packed (THD) attention has no "
                         "prompt-to-response mask; set model.use_transformer_engine=false (the local or flash attention)")
    if spec.moe is not None:
        raise ValueError(f"trainer.shared_prefix on {spec.architecture}: the routers' load-balancing statistics and "
                         "aux loss would count the shared prompt once instead of once per response; not built for "
                         "mixture-of-experts models")


class PromptMismatch(ValueError):
    """Samples of one group whose prompt tokens differ (e.g. agent trajectories that re-tokenised
    their history): their prefix cannot be shared."""


def shared_units(tokens: torch.Tensor, lengths: Sequence[int], prompt_lengths: Sequence[int],
                 group_ids: Sequence[int], *, max_tokens: int, max_samples: int) -> list[Unit]:
    """The batch's samples as units: per group, its samples (in batch order) sharing the group's
    prompt, split so that each unit fits `max_tokens` (0 = no budget) and `max_samples`."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        groups[int(g)].append(i)
    units: list[Unit] = []
    for g, members in groups.items():
        prefix = int(prompt_lengths[members[0]])
        first = tokens[members[0], :prefix]
        for i in members[1:]:
            if int(prompt_lengths[i]) != prefix or not torch.equal(tokens[i, :prefix], first):
                raise PromptMismatch(
                    f"trainer.shared_prefix: samples {members[0]} and {i} of group {g} have different prompt "
                    f"tokens ({prefix} vs {int(prompt_lengths[i])} tokens); a shared prefix needs every sample of "
                    "a group to start with the same prompt ids (agent trajectories that re-tokenise their "
                    "history do not): set trainer.shared_prefix=false")
        current: list[int] = []
        for i in members:
            if max_tokens > 0 and lengths[i] > max_tokens:
                raise SampleTooLong(f"sample {i} has {lengths[i]} tokens (prompt + response), more than "
                                    f"trainer.max_tokens_per_micro_batch={max_tokens}")
            grown = current + [i]
            size = prefix + sum(lengths[j] - prefix for j in grown)
            if current and ((max_tokens > 0 and size > max_tokens) or len(grown) > max_samples):
                units.append(_unit(current, prefix))
                grown = [i]
            current = grown
        units.append(_unit(current, prefix))
    return units


@dataclasses.dataclass(frozen=True)
class Sharing:
    """What a step's shared layout saves (trainer.shared_prefix)."""

    flops: Optional[float]  # model FLOPs of the shared layout, a split group's prompt once per part
    saved_frac: float  # tokens not recomputed / the batch's tokens (train/shared_prefix_saved_frac)
    unshared: str  # why nothing is shared ("" when something is)


def sharing(spec: Any, batch: Any, lengths: Sequence[int], *, max_tokens: int, max_samples: int,
            adapter_weights: int = 0) -> Sharing:
    """The shared layout of `batch` as the micro-batches lay it out (micro_batches.py `_packed`)."""
    from megatron_flash.trainer.flops import shared_flops

    if batch.group_ids is None or batch.prompt_lengths is None:
        return Sharing(None, 0.0, "the batch carries no group_ids or prompt_lengths (e.g. a replay dump "
                                  "written without them), so every sample is laid out whole")
    units = shared_units(batch.tokens, lengths, batch.prompt_lengths.tolist(), batch.group_ids.tolist(),
                         max_tokens=max_tokens, max_samples=max_samples)
    saved = sum(u.prefix * (len(u.samples) - 1) for u in units)
    flops = sum(shared_flops(spec, u.prefix, [lengths[i] for i in u.samples], adapter_weights=adapter_weights)
                for u in units)
    why = "" if saved else ("no group has two samples in one unit (groups of one, or a token budget or "
                            "micro_batch_size that splits every group apart)")
    return Sharing(flops, saved / max(sum(lengths), 1), why)


class UnsharedWarning:
    """One warning line the first time a batch shares nothing, then one per `every` such batches."""

    def __init__(self, *, enabled: bool = True, every: int = 100) -> None:
        self.enabled, self.every, self.count = enabled, every, 0

    def __call__(self, reason: str) -> None:
        if not reason:
            return
        self.count += 1
        if self.enabled and (self.count - 1) % self.every == 0:
            logger.warning("trainer.shared_prefix=true, but this batch shares nothing: %s (%d such batches so far)",
                           reason, self.count)


def _unit(samples: list[int], prefix: int) -> Unit:
    return Unit(tuple(samples), prefix if len(samples) > 1 else 0)


@dataclasses.dataclass
class Layout:
    """A packed row with shared prefixes, as the trainer feeds and reads it."""

    tokens: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T] RoPE positions (responses continue from |P|)
    index: torch.Tensor  # [n, w] into the row's per-token values, then the extras (T + k)
    valid: torch.Tensor  # [n, w]
    extra_src: torch.Tensor  # [K] row positions whose logits predict…
    extra_rows: torch.Tensor  # [K] …sample (micro-batch row) …
    extra_cols: torch.Tensor  # [K] …token at this column (its first response token)
    local_plan: list  # [(q_index [sq, b], k_index [sk, b], mask [sq, sk] | None)]
    flash_plan: dict  # cu_q, cu_k, k_index, max_q, max_k


def row_layout(mb: MicroBatch, tokens: torch.Tensor, width: int, *, pad_id: int = 0) -> Layout:
    """The row of a micro-batch whose `segments` share prefixes; `tokens` [B, S] the global batch."""
    parts: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    n = len(mb.indices)
    index = torch.zeros(n, width, dtype=torch.long)
    cols = torch.arange(width)
    valid = cols[None, :] < torch.tensor(mb.lengths)[:, None]
    extra_src: list[int] = []
    extra_rows: list[int] = []
    extra_cols: list[int] = []
    # attention sequences: (query start, query length, key spans [(start, length), ...])
    sequences: list[tuple[int, int, list[tuple[int, int]]]] = []
    start = j = 0
    for k, prefix in mb.segment_spans():
        members = list(range(j, j + k))
        lens = [mb.lengths[m] for m in members]
        if prefix == 0:  # a sample alone
            (m,), (length,) = members, lens
            parts.append(tokens[mb.indices[m], :length])
            positions.append(torch.arange(length))
            index[m] = torch.where(valid[m], start + cols, 0)
            sequences.append((start, length, [(start, length)]))
            start += length
        else:
            parts.append(tokens[mb.indices[members[0]], :prefix])
            positions.append(torch.arange(prefix))
            sequences.append((start, prefix, [(start, prefix)]))
            offset = start + prefix
            for m, length in zip(members, lens):
                rest = length - prefix
                parts.append(tokens[mb.indices[m], prefix:length])
                positions.append(torch.arange(prefix, length))
                where = torch.where(cols < prefix, start + cols, offset + cols - prefix)
                index[m] = torch.where(valid[m], where, 0)
                if rest > 0:
                    if offset != start + prefix:  # the row's next token there is R1's, not Rj's
                        index[m, prefix] = -1 - len(extra_src)  # resolved to T + k below
                        extra_src.append(start + prefix - 1)
                        extra_rows.append(m)
                        extra_cols.append(prefix)
                    sequences.append((offset, rest, [(start, prefix), (offset, rest)]))
                offset += rest
            start = offset
        j += k
    tail = mb.row_len - start
    if tail:
        parts.append(torch.full((tail,), pad_id, dtype=tokens.dtype))
        positions.append(torch.arange(tail))
        sequences.append((start, tail, [(start, tail)]))
    index = torch.where(index < 0, mb.row_len - 1 - index, index)  # -1 - k → T + k
    return Layout(tokens=torch.cat(parts).unsqueeze(0), positions=torch.cat(positions).unsqueeze(0), index=index,
                  valid=valid, extra_src=torch.tensor(extra_src, dtype=torch.long),
                  extra_rows=torch.tensor(extra_rows, dtype=torch.long),
                  extra_cols=torch.tensor(extra_cols, dtype=torch.long),
                  local_plan=_local_plan(sequences), flash_plan=_flash_plan(sequences))


def _local_plan(sequences: list) -> list:
    """Per (query length, key spans' shape): index tensors [len, b] for the queries and keys of b
    sequences batched side by side, and the bottom-right causal mask (None: plain causal)."""
    by_shape: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
    for q_start, q_len, spans in sequences:
        q = torch.arange(q_start, q_start + q_len)
        k = torch.cat([torch.arange(s, s + n) for s, n in spans])
        by_shape[(q_len, k.numel())].append((q, k))
    plan = []
    for (q_len, k_len), members in by_shape.items():
        q_index = torch.stack([q for q, _ in members], dim=1)
        k_index = torch.stack([k for _, k in members], dim=1)
        # True = masked: query i sees keys ≤ i + (k_len − q_len)
        mask = None if q_len == k_len else torch.ones(q_len, k_len, dtype=torch.bool).triu(k_len - q_len + 1)
        plan.append((q_index, k_index, mask))
    return plan


def _flash_plan(sequences: list) -> dict:
    q_lens = [q_len for _, q_len, _ in sequences]
    k_index = torch.cat([torch.arange(s, s + n) for _, _, spans in sequences for s, n in spans])
    k_lens = [sum(n for _, n in spans) for _, _, spans in sequences]

    def cu(lens: list[int]) -> torch.Tensor:
        out = torch.zeros(len(lens) + 1, dtype=torch.int32)
        out[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
        return out

    return {"cu_q": cu(q_lens), "cu_k": cu(k_lens), "k_index": k_index, "max_q": max(q_lens), "max_k": max(k_lens)}


def with_plans(params: Any, layout: Layout, device: torch.device) -> Any:
    """The row's PackedSeqParams carrying its attention plans (trainer/attention_plan.py) on `device`."""
    return attention_plan.with_plan(params, local_plan=layout.local_plan, flash_plan=layout.flash_plan, device=device)

