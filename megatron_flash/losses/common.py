"""Shared pieces of the per-token losses: inputs/outputs, safe ratios, masked statistics, checks.

Shapes: B sequences, T token positions. Every tensor handed to a loss formula is [B, T] except
``rewards`` ([B]). ``loss_mask`` inside a formula is a bool tensor of the tokens it may train
(response tokens minus those a mismatch mask dropped); the formula returns the per-token loss and,
optionally, a bool ``keep`` mask of tokens it decided not to train (e.g. decoupled PPO's cap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

# exp() of a log-ratio beyond ±20 is either ~0 or ~5e8; clamping keeps values and gradients finite
# even for log-ratios of ±100 (the clamp passes no gradient outside the range).
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class LossInputs:
    """What a loss formula sees. Masked-out (padding) positions hold 0 in every [B, T] tensor.

    Attributes:
        logprobs: log π_θ of the sampled tokens, [B, T], carries the gradient.
        behavior_logprobs: log μ recorded by the engine at sampling, [B, T], detached.
        proximal_logprobs: log π_prox, [B, T], detached; equals ``behavior_logprobs`` when the
            caller passed none (on-policy case).
        advantages: A per token, [B, T], detached.
        loss_mask: bool [B, T], tokens the formula may train.
        rewards: sequence rewards [B], or None when the caller passed none.
        reference_logprobs: log π_ref [B, T] detached, or None.
    """

    logprobs: torch.Tensor
    behavior_logprobs: torch.Tensor
    proximal_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    rewards: torch.Tensor | None
    reference_logprobs: torch.Tensor | None


class LossTerms(NamedTuple):
    """What a loss formula returns.

    Attributes:
        per_token_loss: [B, T]; values outside ``loss_mask & keep`` are ignored (zeroed later).
        metrics: name → 0-dim tensor, computed over the tokens the formula trains.
        keep: bool [B, T] of tokens the formula trains, or None for "all of ``loss_mask``".
    """

    per_token_loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    keep: torch.Tensor | None = None


LossFn = Callable[[LossInputs], LossTerms]


def clamped_log_ratio(log_num: torch.Tensor, log_den: torch.Tensor) -> torch.Tensor:
    """log(num/den) clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]."""
    return (log_num - log_den).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def safe_ratio(log_num: torch.Tensor, log_den: torch.Tensor) -> torch.Tensor:
    """num/den from log-probabilities, with the log-ratio clamped before exp."""
    return torch.exp(clamped_log_ratio(log_num, log_den))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over ``mask`` (bool), 0 when the mask is empty; detached, 0-dim."""
    values = values.detach()
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return total / mask.sum().clamp(min=1).to(values.dtype)


def masked_frac(condition: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Fraction of ``mask`` tokens where ``condition`` holds (0 for an empty mask); 0-dim."""
    hits = (condition & mask).sum().to(dtype)
    return hits / mask.sum().clamp(min=1).to(dtype)


def weight_metrics(weights: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``is_weight_mean/max/min`` of the importance weights over ``mask`` (all 0 if empty)."""
    # Built with where() instead of weights[mask] so that no host sync happens on GPU.
    weights = weights.detach()
    inf = torch.full_like(weights, math.inf)
    any_token = mask.any()
    zero = weights.new_zeros(())
    largest = torch.where(mask, weights, -inf).max()
    smallest = torch.where(mask, weights, inf).min()
    return {
        "is_weight_mean": masked_mean(weights, mask),
        "is_weight_max": torch.where(any_token, largest, zero),
        "is_weight_min": torch.where(any_token, smallest, zero),
    }


def truncated_pg(
    batch: LossInputs, *, lower: float, upper: float, weight_logprobs: torch.Tensor | None = None
) -> LossTerms:
    """−sg(clamp(ρ, lower, upper))·A·log π_θ with ρ = π_θ/μ (TIS / CISPO form).

    ``weight_logprobs`` overrides log ρ (already a log-ratio) when given.
    """
    log_rho = (
        clamped_log_ratio(batch.logprobs.detach(), batch.behavior_logprobs)
        if weight_logprobs is None
        else weight_logprobs
    )
    rho = torch.exp(log_rho)
    weight = rho.clamp(min=lower, max=upper)
    loss = -weight * batch.advantages * batch.logprobs
    mask = batch.loss_mask
    metrics = weight_metrics(weight, mask)
    metrics["clip_frac_low"] = masked_frac(rho < lower, mask, loss.dtype)
    metrics["clip_frac_high"] = masked_frac(rho > upper, mask, loss.dtype)
    return LossTerms(loss, metrics)


def check_number(
    loss: str,
    param: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Validate a numeric loss parameter and return it as float; ValueError names loss and param."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"loss {loss!r} parameter {param!r} must be a finite number, got {value!r}")
    bad_low = low is not None and (value <= low if low_open else value < low)
    bad_high = high is not None and (value >= high if high_open else value > high)
    if bad_low or bad_high:
        left = "-inf" if low is None else f"{low:g}"
        right = "inf" if high is None else f"{high:g}"
        opening = "(" if low_open or low is None else "["
        closing = ")" if high_open or high is None else "]"
        interval = f"{opening}{left}, {right}{closing}"
        raise ValueError(f"loss {loss!r} parameter {param!r} must be in {interval}, got {value!r}")
    return float(value)


def check_choice(loss: str, param: str, value: object, choices: Sequence[str]) -> str:
    """Validate a string parameter against its allowed values."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"loss {loss!r} parameter {param!r} must be one of {', '.join(choices)}; got {value!r}"
        )
    return value
