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

Top-K (distill.topk = K > 0). The sampled-token k_t collapsed at α ≥ 1 on sort4: a stale sample never
shows the student the tokens it now over-weights. Instead the teacher's K most likely tokens at each
visited position and their logprobs t_1..t_K come with the sample, the training forward gives the
student's s_k = log π_θ of the same K tokens, and the reverse KL over those K tokens plus one bucket
for the rest of the vocabulary becomes a loss term, coef · KL_t on every trained token:

    KL_t = Σ_k e^{s_k} (s_k − t_k) + r_s (log r_s − log r_t),   r = 1 − Σ_k e^{(·)_k}  (the rest's mass)

(e.g. K = 1, s = log 0.5, t = log 0.8: 0.5·log(0.5/0.8) + 0.5·log(0.5/0.2) = 0.2231). It is the exact
reverse KL of the two distributions coarsened to K + 1 outcomes (≤ the full one; equal when the two
are proportional outside the top-K). The gradient reaches all K + 1 student masses; no
importance weight: it is the KL of the policy at each visited state, whichever policy visited it. The
task advantage stays A_t (add) or 0 (only).
"""

from __future__ import annotations

import math

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


REST_FLOOR = 1e-6
"""Smallest rest mass taken: a top-K that holds (numerically) all the mass leaves log r finite."""


def topk_reverse_kl(student_topk: torch.Tensor, teacher_topk: torch.Tensor) -> torch.Tensor:
    """[..., K] student / teacher logprobs of the teacher's top-K tokens → [...] KL_t of the module
    docstring (float32; differentiable in the student's logprobs)."""
    s = student_topk.to(torch.float32)
    t = teacher_topk.to(torch.float32)

    def log_rest(lp: torch.Tensor) -> torch.Tensor:
        total = torch.logsumexp(lp, dim=-1).clamp(max=math.log1p(-REST_FLOOR))
        return torch.log(-torch.expm1(total))

    rs, rt = log_rest(s), log_rest(t)
    return (s.exp() * (s - t)).sum(dim=-1) + rs.exp() * (rs - rt)
