"""Evaluation metrics: the unbiased pass@k against hand-computed values, and `evaluate` over a fake
engine whose rewards are known, so mean@n and pass@k can be worked out by hand."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from megatron_flash.rollout.dataset import Prompt
from megatron_flash.rollout.evaluation import EvalSet, EvalSettings, evaluate, ks_for, pass_at_k


def test_pass_at_k_hand_values() -> None:
    # n = 5 samples, c = 2 correct: pass@1 = 2/5; pass@2 = 1 − C(3,2)/C(5,2) = 1 − 3/10; pass@4 = 1 − 0
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # C(3,3)/C(5,3) = 1/10
    assert pass_at_k(5, 2, 4) == 1.0 and pass_at_k(5, 0, 5) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)
    assert ks_for(8) == [1, 2, 4, 8] and ks_for(6) == [1, 2, 4, 6] and ks_for(1) == [1]


class FakeProxy:
    """Sample i of prompt p answers with i + p tokens; version '3' except for one reply."""

    async def generate(self, input_ids, params, *, rid):
        _, _, index, sample = rid.split("-")
        n = int(index) + int(sample)
        version = "2" if rid == "eval-s-1-3" else "3"
        return SimpleNamespace(output_ids=[7] * n, finish_reason="length" if n >= 4 else "stop",
                               weight_version=version)


class LengthReward:
    """Reward 1 when the response has an even number of tokens, else 0.25."""

    async def score(self, text, answer, *, finished, prompt, meta):
        return SimpleNamespace(reward=1.0 if len(text) % 2 == 0 else 0.25)


def test_evaluate_reports_mean_pass_at_k_and_off_version_replies() -> None:
    prompts = [Prompt(index=i, text=f"p{i}", prompt_ids=[1, 2], answer="", meta={}) for i in range(3)]
    settings = EvalSettings(n_samples=4, max_new_tokens=8, temperature=1.0, correct_threshold=1.0, version="3")
    metrics, records = asyncio.run(evaluate(FakeProxy(), [EvalSet("s", prompts)], LengthReward(),
                                            lambda ids: "x" * len(ids), settings))
    # prompt p, sample i → length p + i; correct when even: each prompt has exactly 2 of 4 correct
    assert len(records) == 12
    assert metrics["eval/s/mean@4"] == pytest.approx((6 * 1.0 + 6 * 0.25) / 12)
    assert metrics["eval/s/pass@1"] == pytest.approx(0.5)
    assert metrics["eval/s/pass@2"] == pytest.approx(1 - 1 / 6)  # 1 − C(2,2)/C(4,2)
    assert metrics["eval/s/pass@4"] == 1.0
    assert metrics["eval/s/off_version"] == 1.0 and metrics["eval/s/num_prompts"] == 3
    assert metrics["eval/s/response_len_mean"] == pytest.approx(sum(p + i for p in range(3) for i in range(4)) / 12)
    assert {r["weight_version"] for r in records} == {"2", "3"}


def test_before_the_first_push_every_reply_must_carry_the_same_label() -> None:
    prompts = [Prompt(index=i, text=f"p{i}", prompt_ids=[1, 2], answer="", meta={}) for i in range(3)]
    settings = EvalSettings(n_samples=4, max_new_tokens=8, temperature=1.0, correct_threshold=1.0, version=None)
    metrics, _ = asyncio.run(evaluate(FakeProxy(), [EvalSet("s", prompts)], LengthReward(),
                                      lambda ids: "x" * len(ids), settings))
    assert metrics["eval/s/off_version"] == 1.0  # eleven replies say "3", one says "2"
