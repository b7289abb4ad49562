"""GSPO (Qwen, "Group Sequence Policy Optimization"): one length-normalised ratio per sequence.

    log s_i = Σ_t m_t (log π_θ,t − log π_old,t) / Σ_t m_t        (π_old = π_prox, μ when none)
    loss_t  = −min(s_i·A_i, clip(s_i, 1−ε_low, 1+ε_high)·A_i)    for every trained token t of i

Every trained token of sequence i carries the sequence's value, so `seq_mean_token_mean` aggregation
gives the GSPO objective (the mean over sequences); gradients flow through s_i only (d loss_t / d log
π_θ,t' = −s_i·A_i·m_t' / Σ m where the unclipped branch is active). A_i is the masked mean of the
sequence's advantages (constant along a response for group-relative estimators). m is the mask the
loss trains (after mismatch masking). The paper's clip range is small (3e-4 / 4e-4): a sequence ratio
is a geometric mean, much closer to 1 than a token's.
"""

from __future__ import annotations

import torch

from megatron_flash.losses.common import LOG_RATIO_CLAMP, LossFn, LossInputs, LossTerms, check_number
from megatron_flash.losses.registry import register_loss


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] mean log-ratio over each row's masked tokens (0 for a row without one), clamped."""
    weights = mask.to(logprobs.dtype)
    total = ((logprobs - old_logprobs) * weights).sum(dim=-1)
    return (total / weights.sum(dim=-1).clamp(min=1)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


@register_loss("gspo", needs_proximal=True)
def gspo(*, eps_low: float = 3e-4, eps_high: float = 4e-4) -> LossFn:
    """GSPO with the paper's clip range by default; use with `loss.aggregation=seq_mean_token_mean`.

    Metrics: clip_frac_seq_low / clip_frac_seq_high (fraction of sequences with a trained token whose
    low / high clip binds), seq_ratio_mean / seq_ratio_max (s_i over those sequences).
    """
    eps_low = check_number("gspo", "eps_low", eps_low, low=0.0, high=1.0, high_open=True)
    eps_high = check_number("gspo", "eps_high", eps_high, low=0.0)

    def loss_fn(batch: LossInputs) -> LossTerms:
        mask = batch.loss_mask
        weights = mask.to(batch.logprobs.dtype)
        count = weights.sum(dim=-1)
        ratio = torch.exp(sequence_log_ratio(batch.logprobs, batch.proximal_logprobs, mask))  # [B]
        advantage = (batch.advantages * weights).sum(dim=-1) / count.clamp(min=1)
        clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
        per_seq = -torch.minimum(ratio * advantage, clipped * advantage)
        per_token = per_seq[:, None].expand_as(batch.logprobs) * weights
        r = ratio.detach()
        trained = count > 0
        n = trained.sum().clamp(min=1).to(per_token.dtype)
        low = (advantage < 0) & (r < 1.0 - eps_low) & trained
        high = (advantage > 0) & (r > 1.0 + eps_high) & trained
        zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
        metrics = {
            "clip_frac_seq_low": low.sum().to(per_token.dtype) / n,
            "clip_frac_seq_high": high.sum().to(per_token.dtype) / n,
            "seq_ratio_mean": torch.where(trained, r, zero).sum() / n,
            "seq_ratio_max": torch.where(trained, r, zero).max() if r.numel() else zero,
        }
        return LossTerms(per_token, metrics)

    return loss_fn
