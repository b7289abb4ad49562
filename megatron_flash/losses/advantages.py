"""Sequence-level advantage estimators and their broadcast to tokens.

All estimators take one scalar reward per response ([N]) and a group id per response ([N], any
integers; responses to the same prompt share one) and return one advantage per response.

    grpo:      A_i = r_i − mean_g(r)                     (group mean baseline)
    rloo:      A_i = r_i − mean_{j ∈ g, j ≠ i}(r_j)      (leave-one-out; a group of one gets 0)
    reinforce: A_i = r_i − mean_batch(r)                 (batch mean baseline; groups ignored)

Rewards must be finite and within ±types.REWARD_LIMIT (1e30; ValueError otherwise): the statistics
are taken in float64, where such rewards cannot overflow, and the advantages returned in the rewards'
dtype. A finite 1e308 used to overflow the group's sums into 0 (or NaN) advantages without a word.

With ``std_normalize`` every estimator divides by (std + eps), where std is the *population*
standard deviation (unbiased=False) of the rewards the baseline was taken over: the group for
grpo/rloo, the whole batch for reinforce. Population std is 0 (not NaN) for a group of one, and a
group whose rewards are all equal gets advantage 0 even with eps = 0.

Worked example, one group, rewards [1, 0, 0, 1]: mean 0.5, population std 0.5;
grpo → [0.5, −0.5, −0.5, 0.5] (÷(0.5+eps) with std_normalize ≈ [1, −1, −1, 1]);
rloo → [1 − 1/3, 0 − 2/3, ...] = [2/3, −2/3, −2/3, 2/3].
"""

from __future__ import annotations

import torch

from megatron_flash.types import REWARD_LIMIT

ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce")


def _group_stats(
    rewards: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-response (group sum, group size, group population std), each [N]."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1
    sums = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, rewards)
    sizes = torch.zeros_like(sums).index_add_(0, inverse, torch.ones_like(rewards))
    means = sums / sizes
    squares = torch.zeros_like(sums).index_add_(0, inverse, (rewards - means[inverse]) ** 2)
    stds = torch.sqrt(squares / sizes)
    return sums[inverse], sizes[inverse], stds[inverse]


def _normalize(centered: torch.Tensor, std: torch.Tensor, eps: float) -> torch.Tensor:
    denominator = std + eps
    safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    return torch.where(denominator > 0, centered / safe, torch.zeros_like(centered))


def compute_advantages(
    name: str,
    *,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantages [N] for rewards [N] grouped by group_ids [N]; see the module docstring."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {', '.join(ADVANTAGE_ESTIMATORS)}")
    if rewards.dim() != 1 or not rewards.is_floating_point():
        raise ValueError(f"rewards must be a float [N] tensor, got {rewards.dtype} {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape or group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(
            f"group_ids must be an integer tensor shaped like rewards {tuple(rewards.shape)}, "
            f"got {group_ids.dtype} {tuple(group_ids.shape)}"
        )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    if rewards.numel() == 0:
        return rewards.clone()
    out_dtype = rewards.dtype
    limit = torch.tensor(REWARD_LIMIT, dtype=out_dtype).item()  # a reward of 1e30 in float32 is 1.00000002e30
    rewards = rewards.detach().to(torch.float64)
    bad = ~(rewards.abs() <= limit)  # NaN too
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        raise ValueError(f"rewards must be finite and within ±{REWARD_LIMIT:g} (types.REWARD_LIMIT): "
                         f"{int(bad.sum())} of {rewards.numel()} are not, e.g. reward[{index}] = "
                         f"{rewards[index].item()!r} (group {int(group_ids[index])})")
    if name == "reinforce":
        centered = rewards - rewards.mean()
        std = rewards.std(unbiased=False).expand_as(rewards)
    else:
        sums, sizes, std = _group_stats(rewards, group_ids)
        if name == "grpo":
            centered = rewards - sums / sizes
        else:
            others = (sizes - 1).clamp(min=1)
            centered = torch.where(sizes > 1, rewards - (sums - rewards) / others, torch.zeros_like(rewards))
    advantages = _normalize(centered, std, eps) if std_normalize else centered
    return advantages.to(out_dtype)
