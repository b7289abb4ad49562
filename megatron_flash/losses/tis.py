"""Truncated importance sampling policy gradient (defaults as in ROLL).

    ρ    = π_θ / μ
    loss = −sg(clamp(ρ, lower, upper)) · A · log π_θ

Shapes: every tensor [B, T]. Gradient w.r.t. log π_θ per token: −clamp(ρ, lower, upper)·A.
Reads only the behavior policy, so the trainer may skip the proximal forward pass.
"""

from __future__ import annotations

from megatron_flash.losses.common import LossFn, LossInputs, LossTerms, check_number, truncated_pg
from megatron_flash.losses.registry import register_loss


@register_loss("tis", describe=(
    "ratio ρ = π_θ/μ (μ: the engine's behaviour policy that sampled the tokens), weight "
    "sg(clamp(ρ, {lower}, {upper})) on −A·log π_θ; behaviour correction: yes (truncated importance sampling)"))
def tis(*, lower: float = 0.0, upper: float = 1.0) -> LossFn:
    """TIS with weights clamped to [lower, upper] (0 ≤ lower ≤ upper).

    Metrics: is_weight_* of the clamped ρ; clip_frac_low / clip_frac_high: fraction of trained
    tokens with ρ below ``lower`` / above ``upper``.
    """
    lower = check_number("tis", "lower", lower, low=0.0)
    upper = check_number("tis", "upper", upper, low=lower)

    def loss_fn(batch: LossInputs) -> LossTerms:
        return truncated_pg(batch, lower=lower, upper=upper)

    return loss_fn
