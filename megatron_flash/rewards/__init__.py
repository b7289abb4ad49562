"""Reward functions and synthetic verifiable tasks (never imports Megatron).

Rewards are picked by name (``rollout.reward``); see ``registry`` for the built-ins, how to
register your own, and ``RewardPool``, which scores responses off the rollout's asyncio loop.
"""

from megatron_flash.rewards.registry import (
    RewardFn,
    RewardOutcome,
    RewardPool,
    get_reward,
    list_rewards,
    register_reward,
)

__all__ = ["RewardFn", "RewardOutcome", "RewardPool", "get_reward", "list_rewards", "register_reward"]
