"""sort4_long, the long-response task: the sorted digits first, and at least response_tokens characters.

The rows carry response_tokens (the reward reads it), the warm-up's format-only answers are a
permutation of the digits then filler up to response_tokens..response_tokens+31 characters, and the
setting is checked when the config loads."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_flash.config import ConfigError, load_config  # noqa: E402
from megatron_flash.rewards import get_reward  # noqa: E402
from megatron_flash.rewards.synthetic import get_task  # noqa: E402


@pytest.mark.parametrize("text,finished,expected", [
    ("1234" + "|" * 6, True, 1.0), ("1234" + "|" * 6, False, 1.0), ("1234" + "x|2" * 9, False, 1.0),
    ("1234" + "|" * 5, True, 0.0), ("1243" + "|" * 6, True, 0.0), ("|1234" + "|" * 6, True, 0.0),
    ("1234", True, 0.0)])
def test_the_reward_asks_for_the_answer_first_and_a_long_response(text: str, finished: bool,
                                                                   expected: float) -> None:
    reward = get_reward("answer_first_long")
    assert reward(text, "1234", finished=finished, meta={"task": "sort4_long", "response_tokens": 10}) == expected


def test_the_reward_names_the_missing_field() -> None:
    with pytest.raises(ValueError, match="needs the row field response_tokens"):
        get_reward("answer_first_long")("1234|", "1234", finished=True, meta={"task": "sort4"})


def test_the_warm_up_answers_are_long_and_the_rows_carry_the_setting() -> None:
    from megatron_flash.rollout.dataset import _make_synthetic

    task, rng = get_task("sort4_long", {"response_tokens": 100}), random.Random(0)
    lengths = set()
    for _ in range(200):
        prompt, answer = task.make(rng)
        assert answer == "".join(sorted(prompt[:4])) and prompt.endswith(":")
        warm = task.format_only(rng, prompt)
        assert 100 <= len(warm) < 132 and sorted(warm[:4]) == sorted(prompt[:4]) and set(warm[4:]) == {"|"}
        lengths.add(len(warm))
    assert len(lengths) > 16
    rows = _make_synthetic("sort4_long", num_samples=3, seed=0, args={"response_tokens": 100})
    assert rows.metas == [{"task": "sort4_long", "response_tokens": 100}] * 3
    assert get_task("sort4_long").meta == {"response_tokens": 2048}


def test_the_setting_is_checked_when_the_config_loads() -> None:
    cfg = load_config(None, ["data.task=sort4_long", "data.task_args={response_tokens: 64}"])
    assert cfg.data.task_args == {"response_tokens": 64}
    with pytest.raises(ConfigError, match=r"^data.task_args.response_tokens must be an integer >= 5"):
        load_config(None, ["data.task=sort4_long", "data.task_args={response_tokens: 4}"])
    with pytest.raises(ConfigError, match=r"^data.task_args.length is not a sort4_long setting"):
        load_config(None, ["data.task=sort4_long", "data.task_args={length: 64}"])
