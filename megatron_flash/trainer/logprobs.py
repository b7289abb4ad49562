"""Log-probabilities and entropy of given tokens from vocabulary-parallel logits.

Each TP rank holds logits for a contiguous slice of the (padded) vocabulary. We never gather the
full vocabulary: the max, the sum of exponentials and the target logit are each one all-reduce of a
[B, S] tensor. Padded vocabulary columns (index ≥ the real vocabulary size) are masked to −inf so
they never take probability mass; this is what makes TP = 1 and TP = 2 (padded differently) agree
with each other and with the HF model.

  logprob(y) = z_y − m − log Σ_v exp(z_v − m)         m = max_v z_v   (z = logits / temperature)
  entropy    = log Σ exp(z − m) + m − Σ_v p_v z_v
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _reduce(x: torch.Tensor, group: Optional[dist.ProcessGroup], tp_size: int) -> torch.Tensor:
    """All-reduce sum forward, identity backward (each rank's slice gets its own gradient)."""
    if tp_size == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=group)


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """logits [B, S, V_local] (this rank's vocabulary slice), targets [B, S] global ids.

    Returns (logprobs [B, S] float32, entropy [B, S] or None). Differentiable w.r.t. logits.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = logits.float() / temperature
    v_local = z.shape[-1]
    start = tp_rank * v_local
    columns = torch.arange(start, start + v_local, device=z.device)
    padded = columns >= vocab_size
    if bool(padded.any()):
        z = z.masked_fill(padded, float("-inf"))

    with torch.no_grad():
        m = z.max(dim=-1).values
        if tp_size > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = z - m.unsqueeze(-1)
    sum_exp = _reduce(shifted.exp().sum(dim=-1), tp_group, tp_size)
    log_z = sum_exp.log()

    local = targets - start
    owned = (local >= 0) & (local < v_local)
    picked = shifted.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    target_shifted = _reduce(torch.where(owned, picked, torch.zeros_like(picked)), tp_group, tp_size)
    logprobs = target_shifted - log_z

    entropy = None
    if with_entropy:
        probs = (shifted - log_z.unsqueeze(-1)).exp()
        p_times_z = (probs * shifted.masked_fill(padded, 0.0)).sum(dim=-1)
        entropy = log_z - _reduce(p_times_z, tp_group, tp_size)
    return logprobs, entropy
