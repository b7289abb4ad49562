"""CISPO (MiniMax-M1): clipped importance-sampling weight, never a clipped gradient.

    ρ    = π_θ / μ
    loss = −sg(clamp(ρ, 1−ε_low, 1+ε_high)) · A · log π_θ

Unlike PPO every token keeps a gradient (−clamp(ρ)·A per token w.r.t. log π_θ); only the weight is
bounded. Shapes: every tensor [B, T]. Reads only the behavior policy.
"""

from __future__ import annotations

from megatron_flash.losses.common import LossFn, LossInputs, LossTerms, check_number, truncated_pg
from megatron_flash.losses.registry import register_loss


@register_loss("cispo", describe=(
    "ratio ρ = π_θ/μ (μ: the engine's behaviour policy that sampled the tokens), weight "
    "sg(clamp(ρ, 1−{eps_low}, 1+{eps_high})) on −A·log π_θ; behaviour correction: yes (a clipped importance "
    "weight; every token keeps its gradient)"))
def cispo(*, eps_low: float = 1.0, eps_high: float = 0.2) -> LossFn:
    """CISPO; the default ``eps_low=1`` leaves the weight unbounded below (clamp at 0).

    Metrics: is_weight_* of the clamped ρ; clip_frac_low / clip_frac_high: fraction of trained
    tokens with ρ below 1−ε_low / above 1+ε_high.
    """
    eps_low = check_number("cispo", "eps_low", eps_low, low=0.0, high=1.0)
    eps_high = check_number("cispo", "eps_high", eps_high, low=0.0)

    def loss_fn(batch: LossInputs) -> LossTerms:
        return truncated_pg(batch, lower=1.0 - eps_low, upper=1.0 + eps_high)

    return loss_fn
