"""Advantage estimators against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_flash.losses import ADVANTAGE_ESTIMATORS, compute_advantages


def adv(name: str, rewards: list[float], groups: list[int], **kwargs) -> list[float]:
    out = compute_advantages(
        name,
        rewards=torch.tensor(rewards, dtype=torch.float64),
        group_ids=torch.tensor(groups),
        **kwargs,
    )
    assert out.dtype == torch.float64 and out.shape == (len(rewards),)
    return out.tolist()


def test_grpo_one_group():
    # mean 0.5, population std 0.5
    assert adv("grpo", [1, 0, 0, 1], [0, 0, 0, 0], std_normalize=False) == [0.5, -0.5, -0.5, 0.5]
    assert adv("grpo", [1, 0, 0, 1], [0, 0, 0, 0], eps=0.0) == [1.0, -1.0, -1.0, 1.0]
    scale = 0.5 / (0.5 + 1e-6)
    assert adv("grpo", [1, 0, 0, 1], [0, 0, 0, 0]) == pytest.approx([scale, -scale, -scale, scale], rel=1e-12)


def test_grpo_two_groups_population_std():
    # group 7: [2, 2, 5, 1] mean 2.5, deviations [-.5, -.5, 2.5, -1.5], variance 9/4, std 1.5
    # group 3: [1, 0] mean 0.5, std 0.5
    got = adv("grpo", [2, 1, 2, 5, 0, 1], [7, 3, 7, 7, 3, 7], eps=0.0)
    assert got == pytest.approx([-1 / 3, 1.0, -1 / 3, 5 / 3, -1.0, -1.0], rel=1e-12)


def test_grpo_constant_group_and_singleton_give_zero():
    assert adv("grpo", [1, 1, 1, 3], [0, 0, 0, 1], eps=0.0) == [0.0, 0.0, 0.0, 0.0]
    assert adv("grpo", [1, 1, 1, 3], [0, 0, 0, 1]) == [0.0, 0.0, 0.0, 0.0]


def test_rloo():
    # r_i − mean of the other three: 1 − 1/3, 0 − 2/3
    got = adv("rloo", [1, 0, 0, 1], [0, 0, 0, 0], std_normalize=False)
    assert got == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3], rel=1e-12)
    # std_normalize divides by the group population std (0.5)
    got = adv("rloo", [1, 0, 0, 1], [0, 0, 0, 0], eps=0.0)
    assert got == pytest.approx([4 / 3, -4 / 3, -4 / 3, 4 / 3], rel=1e-12)
    # group of size 1 → 0; group [3, 1]: 3 − 1 = 2, 1 − 3 = −2
    got = adv("rloo", [5, 3, 1], [9, 4, 4], std_normalize=False)
    assert got == [0.0, 2.0, -2.0]


def test_reinforce_uses_batch_mean():
    # mean 1; deviations [0, -1, -1, 0, 2]; population variance 6/5
    got = adv("reinforce", [1, 0, 0, 1, 3], [0, 0, 1, 1, 2], std_normalize=False)
    assert got == [0.0, -1.0, -1.0, 0.0, 2.0]
    std = math.sqrt(6 / 5)
    got = adv("reinforce", [1, 0, 0, 1, 3], [0, 0, 1, 1, 2], eps=0.0)
    assert got == pytest.approx([0.0, -1 / std, -1 / std, 0.0, 2 / std], rel=1e-12)


def test_unknown_estimator_lists_names():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; known: grpo, rloo, reinforce"):
        adv("ppo", [1.0], [0])
    assert ADVANTAGE_ESTIMATORS == ("grpo", "rloo", "reinforce")


@pytest.mark.parametrize(("rewards", "groups", "kwargs", "pattern"), [
    (torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long), {}, "rewards"),
    (torch.ones(3), torch.zeros(2, dtype=torch.long), {}, "group_ids"),
    (torch.ones(3), torch.zeros(3), {}, "group_ids"),
    (torch.ones(3), torch.zeros(3, dtype=torch.long), {"eps": -1.0}, "eps.*-1.0"),
])
def test_bad_inputs(rewards, groups, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        compute_advantages("grpo", rewards=rewards, group_ids=groups, **kwargs)


@pytest.mark.parametrize("reward", [1e308, -1e31, float("inf"), float("nan")])
def test_a_reward_beyond_the_limit_is_refused_not_zeroed(reward):
    # 1e308 is finite, but a group's sum of two overflows: its advantages used to come out 0
    with pytest.raises(ValueError, match=r"rewards must be finite and within ±1e\+30 \(types.REWARD_LIMIT\): "
                                         r"1 of 3 are not, e.g. reward\[1\] = .* \(group 4\)"):
        adv("grpo", [1.0, reward, 0.0], [3, 4, 4])


def test_rewards_at_the_limit_keep_their_signal_in_float32():
    # float32 squares of 1e30 overflow (max 3.4e38); the statistics are taken in float64 instead.
    # group [1e30, -1e30]: mean 0, population std 1e30 → normalised [1, -1]; unnormalised ±1e30
    rewards = torch.tensor([1e30, -1e30, 3.0, 5.0], dtype=torch.float32)
    groups = torch.tensor([0, 0, 1, 1])
    out = compute_advantages("grpo", rewards=rewards, group_ids=groups, eps=0.0)
    assert out.dtype == torch.float32 and out.tolist() == [1.0, -1.0, -1.0, 1.0]
    raw = compute_advantages("grpo", rewards=rewards, group_ids=groups, std_normalize=False)
    assert raw.tolist() == pytest.approx([1e30, -1e30, -1.0, 1.0], rel=1e-6)
