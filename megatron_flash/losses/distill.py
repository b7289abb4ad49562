"""On-policy distillation's per-token advantage (distill.*): the teacher's reverse-KL estimate on the
student's own sampled token enters the advantage.

    k_t = log π_student(y_t) − log π_teacher(y_t)
    add:   Â_t = A_t − coef · k_t          only:  Â_t = −coef · k_t

on trained tokens, 0 elsewhere (e.g. log π_student = −2.0, log π_teacher = −0.5, coef 1: k = −1.5, so
the token the teacher likes better than the student does gets +1.5 added).

Which student logprob (distill.student_logprobs):
  current   sg(log π_θ) from the training forward itself, inside the loss: the reverse KL of the policy
            being trained, at no extra forward. With one optimizer step per batch this is π_prox, the
            weights the step starts from (slime's OPD takes the student's logprobs from the trainer too).
  behavior  log μ, the student engine's logprob when it sampled the token. At α > 0 μ lags the trained
            policy by up to α versions, so k_t keeps pushing a token the policy already moved: measured
            on sort4 at α = 2 it drove the student into ending its answers early (docs/distillation.md).
"""

from __future__ import annotations

import torch

DISTILL_MODES = ("add", "only")
STUDENT_LOGPROBS = ("current", "behavior")


def distill_advantages(*, advantages: torch.Tensor, student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                       loss_mask: torch.Tensor, coef: float, mode: str) -> torch.Tensor:
    """[B, S] Â_t of the module docstring from [B, S] task advantages and student/teacher logprobs of
    the sampled tokens (`student_logprobs` is detached here: k_t is a reward, not a path for gradients)."""
    if mode not in DISTILL_MODES:
        raise ValueError(f"distill mode must be one of {DISTILL_MODES}, got {mode!r}")
    mask = (loss_mask != 0).to(torch.float32)
    kl = (student_logprobs.detach().to(torch.float32) - teacher_logprobs.to(torch.float32)) * mask
    base = advantages.to(torch.float32) if mode == "add" else torch.zeros_like(kl)
    return ((base - coef * kl) * mask).to(advantages.dtype)
