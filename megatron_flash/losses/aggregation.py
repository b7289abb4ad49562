"""Reduce per-token losses to Megatron's per-token loss contract.

With ``calculate_per_token_loss=True`` each micro-batch's loss function returns
``(loss_sum, num_tokens, metrics)``; Megatron sums ``loss_sum`` gradients and ``num_tokens`` over
micro-batches and DP ranks and divides the gradient by the global ``num_tokens``. ``aggregate``
therefore returns a numerator and a denominator that are both *sums over sequences*, so the final
gradient is the same for any micro-batch / DP split of the global batch:

    token_mean               loss_sum = Σ_{b,t} l·m                 denominator = Σ_{b,t} m
    seq_mean_token_mean      loss_sum = Σ_b (Σ_t l·m / Σ_t m)       denominator = #{b : Σ_t m ≥ 1}
    seq_mean_token_sum       loss_sum = Σ_b Σ_t l·m                 denominator = #{b : Σ_t m ≥ 1}
    seq_mean_token_sum_norm  loss_sum = Σ_b Σ_t l·m / C             denominator = #{b : Σ_t m ≥ 1}
                             (C a fixed constant, `norm`: e.g. the longest response allowed, as
                             Dr. GRPO; every token then weighs the same whatever its sequence's length)
    (sequences without a trained token contribute nothing)

Worked example, two sequences with 1 and 3 trained tokens of loss 1 each: token_mean gives 4/4;
seq_mean_token_mean gives (1 + 1)/2. Split into two micro-batches of one sequence: token_mean sums
(1 + 3)/(1 + 3), seq_mean_token_mean (1 + 1)/(1 + 1) — the same.

Pass the response mask (the ``loss_mask`` given to the loss), not the mask of tokens the loss
kept: tokens a loss drops count as zero-loss tokens, so dropping never up-weights the survivors.
"""

from __future__ import annotations

import torch

AGGREGATION_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def aggregate(
    per_token_loss: torch.Tensor, loss_mask: torch.Tensor, *, mode: str = "token_mean", norm: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, denominator): a 0-dim loss with grad and a 0-dim int32 count (no grad). `norm`: the
    constant C of seq_mean_token_sum_norm (required there, refused elsewhere)."""
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; known: {', '.join(AGGREGATION_MODES)}")
    if (mode == "seq_mean_token_sum_norm") != (norm is not None):
        raise ValueError(f"aggregation {mode!r}: norm is {'required' if norm is None else 'only for seq_mean_token_sum_norm'}")
    if norm is not None and not norm > 0:
        raise ValueError(f"aggregation norm must be > 0, got {norm!r}")
    if per_token_loss.dim() != 2 or loss_mask.shape != per_token_loss.shape:
        raise ValueError(
            f"expected per_token_loss and loss_mask of the same [B, T] shape, got "
            f"{tuple(per_token_loss.shape)} and {tuple(loss_mask.shape)}"
        )
    mask = loss_mask != 0
    masked = torch.where(mask, per_token_loss, torch.zeros_like(per_token_loss))
    if mode == "token_mean":
        return masked.sum(), mask.sum().to(torch.int32)
    num_tokens = mask.sum(dim=-1)
    sequences = (num_tokens > 0).sum().to(torch.int32)
    if mode == "seq_mean_token_sum":
        return masked.sum(), sequences
    if mode == "seq_mean_token_sum_norm":
        return masked.sum() / norm, sequences
    per_seq = masked.sum(dim=-1) / num_tokens.clamp(min=1).to(per_token_loss.dtype)
    return per_seq.sum(), sequences
