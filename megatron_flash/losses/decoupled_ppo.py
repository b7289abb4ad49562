"""Decoupled PPO (Hilton et al. 2021, as in AReaL): PPO trust region around π_prox, off-policy
correction from the behavior policy μ as a detached weight.

    w    = sg(π_prox / μ)          tokens with w > weight_cap are dropped (zero loss, counted)
    r    = π_θ / π_prox
    loss = −w · min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)

Shapes: every tensor [B, T]. Without proximal logprobs π_prox = μ, so w = 1 and this is plain PPO.
Gradient w.r.t. log π_θ per token: −w·r·A where the unclipped branch is active, else 0.
"""

from __future__ import annotations

from typing import Mapping

from megatron_flash.losses.common import (
    LossFn,
    LossInputs,
    LossTerms,
    check_number,
    safe_ratio,
    weight_metrics,
)
from megatron_flash.losses.ppo import check_clip, clipped_surrogate
from megatron_flash.losses.registry import register_loss


def _describe(params: Mapping[str, object]) -> str:
    cap = "" if params["weight_cap"] is None else f", tokens with weight > {params['weight_cap']} dropped"
    return (f"ratio π_θ/π_prox (π_prox: the trainer's weights at the start of the step) clipped to "
            f"[1−{params['eps_low']}, 1+{params['eps_high']}]; behaviour correction: yes, detached weight "
            f"π_prox/μ (μ: the engine's behaviour policy that sampled the tokens){cap}")


@register_loss("decoupled_ppo", needs_proximal=True, describe=_describe)
def decoupled_ppo(
    *, eps_low: float = 0.2, eps_high: float = 0.2, weight_cap: float | None = None
) -> LossFn:
    """Decoupled PPO; ``weight_cap`` (> 0) drops tokens whose behavior weight π_prox/μ exceeds it.

    Metrics: is_weight_* of w over trained tokens, clip_frac_low / clip_frac_high of r as in PPO;
    capped tokens appear in the shared ``loss_dropped_frac`` / ``dropped_frac``.
    """
    eps_low, eps_high = check_clip("decoupled_ppo", eps_low, eps_high)
    if weight_cap is not None:
        weight_cap = check_number("decoupled_ppo", "weight_cap", weight_cap, low=0.0, low_open=True)

    def loss_fn(batch: LossInputs) -> LossTerms:
        weight = safe_ratio(batch.proximal_logprobs, batch.behavior_logprobs).detach()
        keep = None if weight_cap is None else weight <= weight_cap
        trained = batch.loss_mask if keep is None else batch.loss_mask & keep
        surrogate, _, clips = clipped_surrogate(batch, eps_low=eps_low, eps_high=eps_high, trained=trained)
        metrics = {**weight_metrics(weight, trained), **clips}
        return LossTerms(weight * surrogate, metrics, keep)

    return loss_fn
