"""GSPO (Qwen, "Group Sequence Policy Optimization"): one length-normalised ratio per sequence.

    log s_i = Σ_t m_t (log π_θ,t − log π_old,t) / Σ_t m_t        (π_old = π_prox, μ when none)
    loss_t  = −min(s_i·A_i, clip(s_i, 1−ε_low, 1+ε_high)·A_i)    for every trained token t of i

Every trained token of sequence i carries the sequence's value, so `seq_mean_token_mean` aggregation
gives the GSPO objective (the mean over sequences); gradients flow through s_i only (d loss_t / d log
π_θ,t' = −s_i·A_i·m_t' / Σ m where the unclipped branch is active). A_i is the masked mean of the
sequence's advantages (constant along a response for group-relative estimators). m is the mask the
loss trains (after mismatch masking). The paper's clip range is small (3e-4 / 4e-4): a sequence ratio
is a geometric mean, much closer to 1 than a token's.

Under asynchrony (samples sampled by μ, up to α versions behind π_prox) the ratio above corrects for
nothing: `behavior_weight="sequence"` multiplies each sequence's loss by a detached,
truncated sequence-level importance weight, the geometric mean of π_prox/μ over its tokens like s_i:

    log w_i = Σ_t m_t (log π_prox,t − log μ_t) / Σ_t m_t,     w_i = min(exp(log w_i), weight_cap)
    loss_t  = −w_i · min(s_i·A_i, clip(s_i, 1−ε_low, 1+ε_high)·A_i)

On-policy (μ = π_prox up to numerics) w_i = 1 and the loss is the paper's; `behavior_weight="none"`
is the paper's formula at any α (a run with stale samples refuses it unless loss.allow_uncorrected).

A sequence weight cannot single out the few tokens whose μ moved most. `behavior_weight="token"` (the
default: better on each of 6 seeds at α = 2 on sort4, 0.719 vs 0.580, docs/benchmarks.md) takes
the paper's GSPO-token form, whose value and (with a constant A_i) gradient are GSPO's,

    s_i,t = sg(s_i) · π_θ,t / sg(π_θ,t)        loss_t = −w_t · min(s_i,t·A_i, clip(s_i,t, 1−ε_low, 1+ε_high)·A_i)
    w_t = min(π_prox,t / μ_t, weight_cap)  (detached)

so each token's share of the sequence gradient, −A_i·s_i·∇log π_θ,t / |y_i| unclipped, is weighted by its
own truncated importance weight, as TIS weights a token's.
"""

from __future__ import annotations

from typing import Mapping

import torch

from megatron_flash.losses.common import LOG_RATIO_CLAMP, LossFn, LossInputs, LossTerms, check_number
from megatron_flash.losses.registry import register_loss


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] mean log-ratio over each row's masked tokens (0 for a row without one), clamped."""
    weights = mask.to(logprobs.dtype)
    total = ((logprobs - old_logprobs) * weights).sum(dim=-1)
    return (total / weights.sum(dim=-1).clamp(min=1)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _describe(params: Mapping[str, object]) -> str:
    ratio = (f"sequence ratio (π_θ/π_prox)^(1/|y|) (the geometric mean over the response; π_prox: the trainer's "
             f"weights at the start of the step) clipped to [1−{params['eps_low']}, 1+{params['eps_high']}]")
    if params["behavior_weight"] == "none":
        return ratio + "; behaviour correction: none"
    if params["behavior_weight"] == "token":
        return (ratio + "; behaviour correction: yes, GSPO-token form with each token's detached weight π_prox/μ "
                f"truncated at {params['weight_cap']} (μ: the engine's behaviour policy that sampled the tokens)")
    return (ratio + "; behaviour correction: yes, detached sequence weight (π_prox/μ)^(1/|y|) truncated at "
            f"{params['weight_cap']} (μ: the engine's behaviour policy that sampled the tokens)")


@register_loss("gspo", needs_proximal=True, on_policy=lambda params: params["behavior_weight"] == "none",
               describe=_describe)
def gspo(*, eps_low: float = 3e-4, eps_high: float = 4e-4, behavior_weight: str = "token",
         weight_cap: float = 1.0) -> LossFn:
    """GSPO with the paper's clip range by default; use with `loss.aggregation=seq_mean_token_mean`.
    ``behavior_weight``: "token" (GSPO-token with a truncated per-token π_prox/μ weight, the
    default), "sequence" (the truncated sequence-level π_prox/μ weight above, capped at
    ``weight_cap``) or "none" (the paper's formula, on-policy data only).

    Metrics: clip_frac_seq_low / clip_frac_seq_high (fraction of sequences with a trained token whose
    low / high clip binds), seq_ratio_mean / seq_ratio_max (s_i over those sequences), and with the
    behaviour weight seq_is_weight_mean / seq_is_weight_max (w_i before the cap) and seq_is_capped_frac.
    """
    eps_low = check_number("gspo", "eps_low", eps_low, low=0.0, high=1.0, high_open=True)
    eps_high = check_number("gspo", "eps_high", eps_high, low=0.0)
    if behavior_weight not in ("sequence", "token", "none"):
        raise ValueError(f"loss gspo: behavior_weight must be 'sequence', 'token' or 'none', got {behavior_weight!r}")
    weight_cap = check_number("gspo", "weight_cap", weight_cap, low=0.0, low_open=True)

    def loss_fn(batch: LossInputs) -> LossTerms:
        mask = batch.loss_mask
        weights = mask.to(batch.logprobs.dtype)
        count = weights.sum(dim=-1)
        ratio = torch.exp(sequence_log_ratio(batch.logprobs, batch.proximal_logprobs, mask))  # [B]
        advantage = (batch.advantages * weights).sum(dim=-1) / count.clamp(min=1)
        if behavior_weight == "token":
            s_tok = ratio.detach()[:, None] * torch.exp(batch.logprobs - batch.logprobs.detach())
            a = advantage[:, None]
            per_tok = -torch.minimum(s_tok * a, s_tok.clamp(1.0 - eps_low, 1.0 + eps_high) * a)
            log_w = (batch.proximal_logprobs - batch.behavior_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            w_tok = torch.exp(log_w).detach() * weights
            per_token = per_tok * w_tok.clamp(max=weight_cap) * weights
        else:
            clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
            per_seq = -torch.minimum(ratio * advantage, clipped * advantage)
            if behavior_weight == "sequence":
                raw = torch.exp(sequence_log_ratio(batch.proximal_logprobs, batch.behavior_logprobs, mask)).detach()
                per_seq = per_seq * raw.clamp(max=weight_cap)
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
        if behavior_weight == "token":
            metrics["token_is_weight_mean"] = w_tok.sum() / weights.sum().clamp(min=1)
            metrics["token_is_capped_frac"] = ((w_tok > weight_cap) & (weights > 0)).sum().to(per_token.dtype) / \
                weights.sum().clamp(min=1)
        if behavior_weight == "sequence":
            metrics["seq_is_weight_mean"] = torch.where(trained, raw, zero).sum() / n
            metrics["seq_is_weight_max"] = torch.where(trained, raw, zero).max() if raw.numel() else zero
            metrics["seq_is_capped_frac"] = ((raw > weight_cap) & trained).sum().to(per_token.dtype) / n
        return LossTerms(per_token, metrics)

    return loss_fn
