"""Plain REINFORCE: no importance correction.

    loss = −A · log π_θ

Shapes: every tensor [B, T]. Gradient w.r.t. log π_θ per token: −A. Correct only on-policy (α = 0);
off-policy data is used as if μ = π_θ.
"""

from __future__ import annotations

import torch

from megatron_flash.losses.common import LossFn, LossInputs, LossTerms, weight_metrics
from megatron_flash.losses.registry import register_loss


@register_loss("reinforce", on_policy=True,
               describe="no ratio: −A·log π_θ; behaviour correction: none (tokens train as if π_θ had "
                        "sampled them)")
def reinforce() -> LossFn:
    """REINFORCE. Metrics: is_weight_* are 1 (no correction), kept for uniform dashboards."""

    def loss_fn(batch: LossInputs) -> LossTerms:
        loss = -batch.advantages * batch.logprobs
        return LossTerms(loss, weight_metrics(torch.ones_like(loss), batch.loss_mask))

    return loss_fn
