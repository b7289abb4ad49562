"""π_prox without a forward pass (`loss.prox_logprobs=approximate`).

Decoupled losses take their trust-region ratio against π_prox, the weights a train step starts from
(version V). `recompute` runs one extra forward over the batch for it. Without that pass:

  * On the step's first optimizer step the weights have not moved yet, so the training forward's own
    logprobs are π_prox exactly: log π_prox = stop_grad(log π_θ). With one optimizer step per batch
    (trainer.num_mini_batches = num_epochs = 1, the common case) this is every step, and nothing is
    approximated (AReaL's `reuse_train_logp`).
  * On a later optimizer step k of K (mini-batches × epochs), π_θ has moved k/K of the way from V
    towards V + 1. With g = the token's behaviour lag V − v_t (versions between the weights that sampled
    it and V) and d = k/K, log π_prox is placed on the line from the behaviour policy (version V − g)
    to π_θ (version V + d) at version V (AReaL's `loglinear` approximation):

        w = g / (g + d)
        log π_prox ≈ log μ + w · (stop_grad(log π_θ) − log μ)

    A fresh token (g = 0) gets w = 0: π_prox = μ, the engine's logprob under the same weights V.

Example: a token sampled two versions ago (g = 2) on the second of two mini-batches (d = 1/2):
w = 2 / 2.5 = 0.8, so log π_prox = log μ + 0.8 · (log π_θ − log μ).
"""

from __future__ import annotations

import torch


def approximate_proximal(*, logprobs: torch.Tensor, behavior_logprobs: torch.Tensor,
                         behavior_lag: torch.Tensor, theta_advance: float) -> torch.Tensor:
    """log π_prox [B, T] (detached) from the current logprobs, the behaviour logprobs and each token's
    behaviour lag g (versions, ≥ 0), where π_θ is `theta_advance` = d ∈ [0, 1) of a version past V."""
    if not 0.0 <= theta_advance < 1.0:
        raise ValueError(f"theta_advance must be in [0, 1), got {theta_advance}")
    current = logprobs.detach()
    if theta_advance == 0.0:
        return current
    lag = behavior_lag.to(current.dtype).clamp(min=0.0)
    weight = lag / (lag + theta_advance)
    behavior = behavior_logprobs.to(current.dtype)
    return behavior + weight * (current - behavior)
