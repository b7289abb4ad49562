"""rollout.min_new_tokens: checked at load, sent to the engines as SGLang's sampling param of that name,
and counted down for a response resumed from its prefix (pause_mode=abort), so the whole response, not
each segment, is at least that long."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_flash.config import ConfigError, load_config  # noqa: E402
from megatron_flash.rollout.runtime import sampling_params  # noqa: E402
from megatron_flash.rollout.scheduler import RolloutScheduler  # noqa: E402


def test_it_reaches_the_engines_only_when_set() -> None:
    assert "min_new_tokens" not in sampling_params(load_config(None, []).rollout)
    cfg = load_config(None, ["rollout.max_new_tokens=100", "rollout.min_new_tokens=40"])
    assert sampling_params(cfg.rollout) == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_new_tokens": 40}


def test_it_is_refused_above_max_new_tokens_or_below_zero() -> None:
    with pytest.raises(ConfigError, match=r"rollout.min_new_tokens.*must be <= max_new_tokens \(100\)"):
        load_config(None, ["rollout.max_new_tokens=100", "rollout.min_new_tokens=101"])
    with pytest.raises(ConfigError, match=r"rollout.min_new_tokens"):
        load_config(None, ["rollout.min_new_tokens=-1"])


@pytest.mark.parametrize("remaining,expected", [(100, 40), (90, 30), (61, 1), (60, 0), (10, 0)])
def test_a_resumed_response_asks_only_for_what_it_still_lacks(remaining: int, expected: int) -> None:
    # max 100, min 40: a response that already has 100 − remaining tokens needs 40 − that many more
    me = types.SimpleNamespace(settings=types.SimpleNamespace(
        sampling_params={"temperature": 1.0, "min_new_tokens": 40}, max_new_tokens=100))
    params = RolloutScheduler._params(me, remaining)
    assert params == {"temperature": 1.0, "min_new_tokens": expected, "max_new_tokens": remaining}
    me.settings.sampling_params = {"temperature": 1.0}
    assert "min_new_tokens" not in RolloutScheduler._params(me, remaining)
