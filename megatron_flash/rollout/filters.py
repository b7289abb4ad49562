"""Dynamic filtering: decide per finished group (all n responses of one prompt) whether it trains.

A filter is ``fn(rewards: Sequence[float]) -> bool`` (True = keep the group), picked by
``rollout.dynamic_filter``. Built-ins:

  none         keep every group
  nonzero_std  drop a group whose rewards are all equal: its group-relative advantages are all
               zero, so it adds no gradient, only cost (DAPO's dynamic sampling)

Your own filter: register it at import of your module, or name it as "module:function"::

    from megatron_flash.rollout.filters import register_filter

    @register_filter("some_correct")
    def some_correct(rewards):          # keep groups where at least one response succeeded
        return max(rewards) > 0
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from megatron_flash.named import lookup, registrar
from megatron_flash.types import REWARD_LIMIT

logger = logging.getLogger(__name__)

FilterFn = Callable[[Sequence[float]], bool]

# Rewards closer than this count as equal: a spread of 1e-17 (0.1 + 0.2 vs 0.3) has no signal, and
# dividing by such a std in GRPO normalisation would blow the advantages up.
EQUAL_TOLERANCE = 1e-9

_FILTERS: dict[str, FilterFn] = {}


register_filter: Callable[[str], Callable[[FilterFn], FilterFn]] = registrar(_FILTERS, what="filter")
"""Decorator registering ``fn(rewards) -> keep`` under ``name`` (a new, non-empty name without ':')."""


def get_filter(name: str) -> FilterFn:
    """The filter registered as ``name``, or the function named by ``"module:function"``."""
    return lookup(name, _FILTERS, what="dynamic filter")


def list_filters() -> list[str]:
    return sorted(_FILTERS)


@register_filter("none")
def keep_all(rewards: Sequence[float]) -> bool:
    return True


@register_filter("nonzero_std")
def nonzero_std(rewards: Sequence[float]) -> bool:
    """Keep a group only if its rewards differ (an empty or one-sample group has no spread)."""
    return len(rewards) > 1 and max(rewards) - min(rewards) > EQUAL_TOLERANCE


def overflowing_rewards(samples: Sequence[Any], *, group_id: int, prompt_index: Any) -> list[float]:
    """Rewards of a finished group beyond ±types.REWARD_LIMIT or not finite (samples the reward pool
    already failed aside), with a warning: the group is dropped as a failed reward, before any filter,
    since such a reward would zero its group's advantages without a word."""
    overflow = [s.reward for s in samples if not s.reward_failed and not abs(s.reward) <= REWARD_LIMIT]
    if overflow:
        logger.warning("group %d (prompt %s) dropped: rewards %s beyond ±%g (types.REWARD_LIMIT); counted in "
                       "reward_overflow and reward_failed", group_id, prompt_index, overflow, REWARD_LIMIT)
    return overflow
