"""TOPR, tapered off-policy REINFORCE (Le Roux et al. 2025).

    positive sequences (reward > 0): loss = −A · log π_θ                 (no correction)
    other sequences:                 loss = −sg(clamp(ρ, 0, 1)) · A · log π_θ

    level="token":    ρ = π_θ/μ per token
    level="sequence": ρ = exp(Σ_t (log π_θ − log μ)) over the sequence's trained tokens (log-ratio
                      clamped before exp), applied to every token of the sequence

Shapes: every tensor [B, T], rewards [B]. Gradient w.r.t. log π_θ per token: −A on positive
sequences (independent of μ), −clamp(ρ, 0, 1)·A on the others.
"""

from __future__ import annotations

import torch

from megatron_flash.losses.common import (
    LOG_RATIO_CLAMP,
    LossFn,
    LossInputs,
    LossTerms,
    check_choice,
    clamped_log_ratio,
    masked_frac,
    weight_metrics,
)
from megatron_flash.losses.registry import register_loss

TOPR_LEVELS = ("token", "sequence")


@register_loss("topr", describe=(
    "ratio ρ = π_θ/μ per {level} (μ: the engine's behaviour policy that sampled the tokens); responses with "
    "reward > 0: −A·log π_θ, others: weight sg(clamp(ρ, 0, 1)) on it; behaviour correction: yes on responses "
    "with reward ≤ 0, none on positive ones (TOPR's design)"))
def topr(*, level: str = "token") -> LossFn:
    """TOPR; needs ``rewards`` on every call.

    Metrics: is_weight_* of the weight used (1 on positive sequences); clip_frac_high: fraction of
    trained tokens on non-positive sequences whose ρ > 1 was truncated; positive_frac: fraction of
    trained tokens on positive sequences.
    """
    level = check_choice("topr", "level", level, TOPR_LEVELS)

    def loss_fn(batch: LossInputs) -> LossTerms:
        if batch.rewards is None:
            raise ValueError("loss 'topr' needs rewards [B], got None")
        logprobs, mask = batch.logprobs, batch.loss_mask
        log_rho = clamped_log_ratio(logprobs.detach(), batch.behavior_logprobs)
        if level == "sequence":
            zeros = torch.zeros_like(log_rho)
            per_token = torch.where(mask, logprobs.detach() - batch.behavior_logprobs, zeros)
            seq_log_rho = per_token.sum(dim=-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            log_rho = seq_log_rho.unsqueeze(-1).expand_as(logprobs)
        rho = torch.exp(log_rho)
        positive = (batch.rewards > 0).unsqueeze(-1).expand_as(logprobs)
        weight = torch.where(positive, torch.ones_like(rho), rho.clamp(0.0, 1.0))
        loss = -weight * batch.advantages * logprobs
        metrics = weight_metrics(weight, mask)
        metrics["clip_frac_high"] = masked_frac(~positive & (rho > 1.0), mask, loss.dtype)
        metrics["positive_frac"] = masked_frac(positive, mask, loss.dtype)
        return LossTerms(loss, metrics)

    return loss_fn
