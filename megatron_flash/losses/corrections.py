"""Loss-independent corrections every loss accepts: train–inference mismatch masking and a KL term.

Both are configured through the common parameters (see ``COMMON_PARAMS``) and applied by the
registry's ``Loss`` wrapper around any formula, built-in or user-registered.

Mismatch masking compares the trainer's proximal policy with the engine's behavior policy on the
same tokens: ratio = π_prox/μ. Numeric differences between engine and trainer kernels make it drift
from 1 even on-policy; tokens (or whole sequences) where it leaves [mismatch_low, mismatch_high]
are dropped from training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_flash.losses.common import LOG_RATIO_CLAMP, check_choice, check_number

MISMATCH_MODES = ("off", "token", "sequence")
KL_ESTIMATORS = ("k1", "k3")


@dataclass(frozen=True)
class CommonParams:
    """Parameters accepted by every loss.

    Attributes:
        mismatch_mask: "off", "token" (drop tokens whose π_prox/μ is outside the range) or
            "sequence" (drop a whole sequence when the geometric mean of π_prox/μ over its
            tokens is outside the range).
        mismatch_low: lower bound of the accepted π_prox/μ range, > 0.
        mismatch_high: upper bound of the accepted π_prox/μ range, > mismatch_low.
        kl_coef: weight of the per-token KL(π_θ‖π_ref) term; 0 disables it.
        kl_estimator: "k1" (log π_θ − log π_ref) or "k3" (exp(Δ) − Δ − 1 with
            Δ = log π_ref − log π_θ).
    """

    mismatch_mask: str = "off"
    mismatch_low: float = 0.5
    mismatch_high: float = 2.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"

    @classmethod
    def from_params(cls, loss: str, params: dict[str, object]) -> CommonParams:
        """Validate the common parameters found in ``params`` (others are ignored here)."""
        defaults = cls()
        mode = check_choice(
            loss, "mismatch_mask", params.get("mismatch_mask", defaults.mismatch_mask), MISMATCH_MODES
        )
        low = check_number(
            loss, "mismatch_low", params.get("mismatch_low", defaults.mismatch_low), low=0.0, low_open=True
        )
        high = check_number(loss, "mismatch_high", params.get("mismatch_high", defaults.mismatch_high))
        if high <= low:
            raise ValueError(
                f"loss {loss!r} parameter 'mismatch_high' must be greater than mismatch_low={low:g}, "
                f"got {high:g}"
            )
        kl_coef = check_number(loss, "kl_coef", params.get("kl_coef", defaults.kl_coef), low=0.0)
        estimator = check_choice(
            loss, "kl_estimator", params.get("kl_estimator", defaults.kl_estimator), KL_ESTIMATORS
        )
        return cls(mode, low, high, kl_coef, estimator)

    def describe(self) -> str:
        """The corrections in effect, as a suffix of a loss's one-line description ("" for none)."""
        out = ""
        if self.mismatch_mask != "off":
            unit = "tokens" if self.mismatch_mask == "token" else "sequences (geometric mean)"
            out += (f"; mismatch masking: {unit} whose π_prox/μ is outside "
                    f"[{self.mismatch_low:g}, {self.mismatch_high:g}] dropped")
        if self.kl_coef > 0:
            out += f"; KL(π_θ‖π_ref) penalty × {self.kl_coef:g} ({self.kl_estimator})"
        return out


COMMON_PARAMS: frozenset[str] = frozenset(CommonParams.__dataclass_fields__)


def mismatch_keep(
    *,
    proximal_logprobs: torch.Tensor | None,
    behavior_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    params: CommonParams,
) -> torch.Tensor:
    """Bool [B, T]: tokens of ``loss_mask`` that survive mismatch masking.

    Without proximal logprobs there is nothing to compare, so nothing is dropped.
    """
    if params.mismatch_mask == "off" or proximal_logprobs is None:
        return loss_mask
    log_ratio = proximal_logprobs - behavior_logprobs
    if params.mismatch_mask == "token":
        ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        inside = (ratio >= params.mismatch_low) & (ratio <= params.mismatch_high)
        return loss_mask & inside
    zeros = torch.zeros_like(log_ratio)
    num_tokens = loss_mask.sum(dim=-1).clamp(min=1).to(log_ratio.dtype)
    mean_log_ratio = torch.where(loss_mask, log_ratio, zeros).sum(dim=-1) / num_tokens
    geo_mean = torch.exp(mean_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    inside = (geo_mean >= params.mismatch_low) & (geo_mean <= params.mismatch_high)
    return loss_mask & inside.unsqueeze(-1)


def kl_penalty(
    *, logprobs: torch.Tensor, reference_logprobs: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Per-token estimate of KL(π_θ‖π_ref) for tokens sampled from π_θ, differentiable in logprobs.

    k1 = log π_θ − log π_ref (unbiased, can be negative per token);
    k3 = exp(Δ) − Δ − 1 with Δ = log π_ref − log π_θ clamped to ±LOG_RATIO_CLAMP (≥ 0).
    """
    if estimator == "k1":
        return logprobs - reference_logprobs
    assert estimator == "k3", estimator
    delta = (reference_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(delta) - delta - 1.0
