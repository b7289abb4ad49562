"""PPO clipped surrogate against the proximal policy.

    r    = π_θ / π_prox                      (π_prox = μ when no proximal logprobs are given)
    loss = −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)
    dual clip (c > 1, A < 0 only): loss = min(max(−r·A, −clip(r)·A), −c·A)

Shapes: every tensor [B, T]. Gradient w.r.t. log π_θ per token: −r·A where the unclipped branch is
active, 0 where clipping (or the dual clip) binds or |log r| exceeds the ratio clamp.
"""

from __future__ import annotations

from typing import Mapping

import torch

from megatron_flash.losses.common import (
    LossFn,
    LossInputs,
    LossTerms,
    check_number,
    masked_frac,
    safe_ratio,
    weight_metrics,
)
from megatron_flash.losses.registry import register_loss


def check_clip(loss: str, eps_low: float, eps_high: float) -> tuple[float, float]:
    """The clip range's parameters of `loss`, checked: 0 ≤ ε_low < 1, ε_high ≥ 0."""
    return (check_number(loss, "eps_low", eps_low, low=0.0, high=1.0, high_open=True),
            check_number(loss, "eps_high", eps_high, low=0.0))


def clipped_surrogate(batch: LossInputs, *, eps_low: float, eps_high: float, trained: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """−min(r·A, clip(r)·A) per token, r = π_θ/π_prox (detached), and the fraction of `trained`
    tokens where the low / high clip binds (clip_frac_low, clip_frac_high)."""
    advantages = batch.advantages
    ratio = safe_ratio(batch.logprobs, batch.proximal_logprobs)
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    r = ratio.detach()
    binds_low = (advantages < 0) & (r < 1.0 - eps_low)
    binds_high = (advantages > 0) & (r > 1.0 + eps_high)
    return loss, r, {"clip_frac_low": masked_frac(binds_low, trained, loss.dtype),
                     "clip_frac_high": masked_frac(binds_high, trained, loss.dtype)}


def _describe(params: Mapping[str, object]) -> str:
    dual = "" if params["dual_clip"] is None else f", dual clip {params['dual_clip']}"
    return (f"ratio π_θ/π_prox (π_prox: the trainer's weights at the start of the step) clipped to "
            f"[1−{params['eps_low']}, 1+{params['eps_high']}]{dual}; behaviour correction: none (tokens the "
            f"engine's μ sampled train as if π_prox had sampled them)")


@register_loss("ppo", needs_proximal=True, on_policy=True, describe=_describe)
def ppo(*, eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None) -> LossFn:
    """Clipped PPO; ``dual_clip`` (> 1) bounds the loss of negative-advantage tokens by −c·A.

    Metrics: clip_frac_low / clip_frac_high (fraction of trained tokens where the low / high clip
    binds, i.e. the gradient is cut), clip_frac_dual (only with ``dual_clip``), is_weight_* of r.
    """
    eps_low, eps_high = check_clip("ppo", eps_low, eps_high)
    if dual_clip is not None:
        dual_clip = check_number("ppo", "dual_clip", dual_clip, low=1.0, low_open=True)

    def loss_fn(batch: LossInputs) -> LossTerms:
        mask = batch.loss_mask
        loss, ratio, clips = clipped_surrogate(batch, eps_low=eps_low, eps_high=eps_high, trained=mask)
        metrics = {**weight_metrics(ratio, mask), **clips}
        if dual_clip is not None:
            negative = batch.advantages < 0
            bound = -dual_clip * batch.advantages
            loss = torch.where(negative, torch.minimum(loss, bound), loss)
            metrics["clip_frac_dual"] = masked_frac(negative & (ratio > dual_clip), mask, loss.dtype)
        return LossTerms(loss, metrics)

    return loss_fn
