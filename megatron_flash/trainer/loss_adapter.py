"""Adapt a registry loss to the trainer's per-micro-batch contract (the trainer never sees names).

The micro-batch (a TrainBatch) carries `loss_mask`, `behavior_logprobs`, `advantages` and optionally
`proximal_logprobs`, `rewards` [B], `reference_logprobs`, `teacher_logprobs`, `teacher_topk_*`; the
returned function computes the per-token loss with the current logprobs (with teacher logprobs, the
advantage first gains on-policy distillation's reverse-KL term taken against those logprobs; with the
teacher's top-K, the loss gains coef · the top-K reverse KL of the student's logprobs of those tokens,
which the trainer passes as `topk_logprobs`; losses/distill.py), then
`(loss_sum, denominator)` by the aggregation mode,
so Megatron's per-token normalisation makes every micro-batch / DP split give the same gradient.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_flash.losses import Loss, aggregate, distill_advantages, topk_reverse_kl
from megatron_flash.losses.proximal import approximate_proximal
from megatron_flash.types import TrainBatch


class RLLossFn:
    """The trainer's loss_fn for a registry loss. With `approximate_prox` and a micro-batch that carries
    no proximal_logprobs, π_prox comes from the training forward itself (losses/proximal.py): the caller
    sets `theta_advance` = k / K before optimizer step k of the K this batch takes."""

    def __init__(self, loss: Loss, *, aggregation: str, norm: Optional[float], approximate_prox: bool,
                 distill: Optional[tuple[float, str]] = None) -> None:
        self.loss = loss
        self.aggregation = aggregation
        self.norm = norm
        self.approximate_prox = approximate_prox and loss.needs_proximal
        self.theta_advance = 0.0
        self.distill = distill  # (coef, mode) when the student's logprobs come from this forward

    def __call__(self, mb: TrainBatch, logprobs: torch.Tensor, entropy: Optional[torch.Tensor],
                 topk_logprobs: Optional[torch.Tensor] = None):
        if mb.behavior_logprobs is None or mb.advantages is None:
            raise ValueError("an RL loss needs the batch's behavior_logprobs and advantages")
        proximal = mb.proximal_logprobs
        if proximal is None and self.approximate_prox:
            if mb.behavior_lag is None:
                raise ValueError("approximating π_prox needs the batch's behavior_lag")
            proximal = approximate_proximal(logprobs=logprobs, behavior_logprobs=mb.behavior_logprobs,
                                            behavior_lag=mb.behavior_lag, theta_advance=self.theta_advance)
        advantages = mb.advantages
        topk_kl = None
        teacher = "the teacher's top-k" if mb.teacher_topk_ids is not None else "teacher logprobs"
        if (mb.teacher_topk_ids is not None or mb.teacher_logprobs is not None) and self.distill is None:
            raise ValueError(f"the batch carries {teacher} but this loss was built without distill settings")
        if mb.teacher_topk_ids is not None:
            if topk_logprobs is None or topk_logprobs.shape != mb.teacher_topk_logprobs.shape:
                raise ValueError("the batch carries the teacher's top-k: the trainer must pass the student's logprobs "
                                 f"of those tokens (topk_logprobs {tuple(mb.teacher_topk_logprobs.shape)}), got "
                                 f"{None if topk_logprobs is None else tuple(topk_logprobs.shape)}")
            coef, mode = self.distill
            topk_kl = topk_reverse_kl(topk_logprobs, mb.teacher_topk_logprobs) * mb.loss_mask
            if mode == "only":
                advantages = torch.zeros_like(advantages)
        elif mb.teacher_logprobs is not None:
            coef, mode = self.distill
            advantages = distill_advantages(advantages=advantages, student_logprobs=logprobs,
                                            teacher_logprobs=mb.teacher_logprobs, loss_mask=mb.loss_mask,
                                            coef=coef, mode=mode)
        per_token, metrics = self.loss(
            logprobs=logprobs,
            behavior_logprobs=mb.behavior_logprobs,
            advantages=advantages,
            loss_mask=mb.loss_mask,
            rewards=mb.rewards,
            proximal_logprobs=proximal,
            reference_logprobs=mb.reference_logprobs,
        )
        if topk_kl is not None:
            per_token = per_token + coef * topk_kl
            metrics = {**metrics, "distill/topk_reverse_kl": topk_kl.detach().sum() / mb.loss_mask.sum().clamp(min=1)}
        loss_sum, denominator = aggregate(per_token, mb.loss_mask, mode=self.aggregation, norm=self.norm)
        if entropy is not None:
            mask = mb.loss_mask
            metrics = {**metrics, "entropy": (entropy.detach() * mask).sum() / mask.sum().clamp(min=1)}
        return loss_sum, denominator, metrics


def make_loss_fn(loss: Loss, *, aggregation: str = "token_mean", norm: Optional[float] = None,
                 approximate_prox: bool = False, distill: Optional[tuple[float, str]] = None) -> RLLossFn:
    return RLLossFn(loss, aggregation=aggregation, norm=norm, approximate_prox=approximate_prox, distill=distill)


def nll_loss_fn(mb: TrainBatch, logprobs: torch.Tensor, entropy: Optional[torch.Tensor]):
    """Supervised next-token loss on `loss_mask` tokens (token mean over the global batch)."""
    mask = mb.loss_mask
    return -(logprobs * mask).sum(), mask.sum().to(torch.int), {}


def build_loss(loss_cfg) -> Loss:
    """The configured loss: `loss.name` + `loss.params`, with the KL settings of the loss section."""
    from megatron_flash.losses import get_loss

    loss = get_loss(loss_cfg.name, **dict(loss_cfg.params), kl_coef=loss_cfg.kl_coef,
                    kl_estimator=loss_cfg.kl_estimator)
    if loss_cfg.prox_logprobs == "approximate" and not loss.needs_proximal:
        raise ValueError(f"loss.prox_logprobs=approximate has nothing to approximate: loss {loss_cfg.name!r} does "
                         "not read π_prox (use it with decoupled_ppo, ppo, gspo or a mismatch mask)")
    return loss


def aggregation_norm(loss_cfg, max_new_tokens: int) -> Optional[float]:
    """C of seq_mean_token_sum_norm: `loss.aggregation_norm`, or the longest response allowed."""
    if loss_cfg.aggregation != "seq_mean_token_sum_norm":
        return None
    return float(loss_cfg.aggregation_norm or max_new_tokens)


def build_loss_fn(loss_cfg, *, max_new_tokens: int = 0):
    """(Loss, trainer loss_fn) from a `LossConfig`; the only place a config becomes a loss."""
    loss = build_loss(loss_cfg)
    return loss, make_loss_fn(loss, aggregation=loss_cfg.aggregation, norm=aggregation_norm(loss_cfg, max_new_tokens),
                              approximate_prox=loss_cfg.prox_logprobs == "approximate")
