"""The agentic env manager with a scripted fake proxy and scripted environments (pure pieces; the
e2e test drives real engines). Expected token layouts are rebuilt here from the chat template."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from megatron_flash.agentic.env_manager import EnvGroupRunner, SeedPrompt
from megatron_flash.rollout.group_runner import GroupDropped
from megatron_flash.engines.client import GenerateResult


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(tiny_models["llama"])


@dataclasses.dataclass
class Step:
    observation: str
    reward: float
    done: bool
    info: dict = dataclasses.field(default_factory=dict)


class CountEnv:
    """Observation 'n:k'; done after `turns` steps with reward 1; optional delays and failures."""

    def __init__(self, *, turns: int = 3, delay: float = 0.0, fail: bool = False, hang: bool = False,
                 obs_len: int = 0) -> None:
        self.turns, self.delay, self.fail, self.hang, self.obs_len = turns, delay, fail, hang, obs_len
        self.k = 0
        self.actions: list[str] = []
        self.closed = False

    async def reset(self, seed: int) -> str:
        return f"n:{seed}"

    async def step(self, action: str) -> Step:
        self.actions.append(action)
        if self.hang:
            await asyncio.sleep(3600)
        if self.fail:
            raise RuntimeError("env exploded")
        await asyncio.sleep(self.delay)
        self.k += 1
        obs = f"n:{self.k}" + "a" * self.obs_len
        return Step(obs, 1.0 if self.k == self.turns else 0.0, self.k == self.turns,
                    {"invalid": action != "r"})

    async def close(self) -> None:
        self.closed = True


class ScriptedProxy:
    def __init__(self, tokenizer, *, action: str = "r", eos: bool = True, latency=lambda rid: 0.0) -> None:
        self.ids = tokenizer(action, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
        self.latency = latency
        self.calls: list[tuple[str, list[int], int]] = []
        self.aborted: list[str] = []

    async def generate(self, input_ids, params, *, rid: str) -> GenerateResult:
        self.calls.append((rid, list(input_ids), params["max_new_tokens"]))
        await asyncio.sleep(self.latency(rid))
        ids = self.ids[: params["max_new_tokens"]]
        return GenerateResult(rid=rid, output_ids=ids, output_logprobs=[-0.25] * len(ids),
                              finish_reason="stop" if ids[-1:] == self.ids[-1:] else "length")

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)


def runner(tokenizer, proxy, envs, **cfg) -> EnvGroupRunner:
    base = dict(env="count", env_params={}, max_turns=8, max_tokens_per_turn=4, max_episode_tokens=200,
                redundancy=0, reset_timeout_s=5.0, step_timeout_s=5.0, system_prompt="", latency={}, seed=0)
    base.update(cfg)
    r = EnvGroupRunner(agentic_cfg=SimpleNamespace(**base), proxy=proxy, tokenizer=tokenizer,
                       sampling_params={"temperature": 1.0}, max_seq_len=256, version_fn=lambda: 0)
    it = iter(envs)
    r._make_env = lambda seed: next(it)
    return r


def test_tokens_masks_and_rewards_follow_the_chat_template(tokenizer) -> None:
    proxy = ScriptedProxy(tokenizer)
    env = CountEnv(turns=3)
    r = runner(tokenizer, proxy, [env])
    [s] = asyncio.run(r.run_group(group_id=7, prompt=SeedPrompt(index=0, seed=5), version=0, group_size=1))

    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tokenizer.eos_token_id
    # The template is  role|content</s>  per message, then "assistant|"; rebuild it by hand.
    assert s.prompt_ids == enc("user|n:5</s>assistant|")
    action = enc("r") + [eos]
    expected, mask = [], []
    for k in (1, 2):
        expected += action + enc(f"user|n:{k}</s>assistant|")
        mask += [1] * len(action) + [0] * len(enc(f"user|n:{k}</s>assistant|"))
    expected += action
    mask += [1] * len(action)
    assert s.response_ids == expected and s.response_mask == mask
    assert s.behavior_logprobs == [(-0.25 if m else 0.0) for m in mask]
    assert s.reward == 1.0 and s.group_id == 7 and env.actions == ["r", "r", "r"] and env.closed
    # Each turn's request is exactly the prompt plus everything so far (no re-tokenisation).
    for (rid, ids, _), cut in zip(proxy.calls, [0, len(action) + len(enc("user|n:1</s>assistant|"))]):
        assert ids == s.prompt_ids + s.response_ids[:cut]
    assert r.stats.episodes == 1 and r.stats.turns == 3 and r.stats.successes == 1


def test_a_turn_cut_by_the_length_limit_gets_an_untrained_end_token(tokenizer) -> None:
    proxy = ScriptedProxy(tokenizer, action="rrrrrr", eos=False)
    r = runner(tokenizer, proxy, [CountEnv(turns=2)], max_tokens_per_turn=3)
    [s] = asyncio.run(r.run_group(group_id=0, prompt=SeedPrompt(index=0, seed=1), version=0, group_size=1))
    eos = tokenizer.eos_token_id
    first_obs = tokenizer("user|n:1</s>assistant|", add_special_tokens=False)["input_ids"]
    assert s.response_ids[:4 + len(first_obs)] == proxy.ids[:3] + [eos] + first_obs
    assert s.response_mask[:4] == [1, 1, 1, 0]
    assert r.stats.invalid_actions == 2  # "rrr" is not the env's valid action "r"


def test_redundant_episodes_first_finishers_win_and_the_rest_are_aborted(tokenizer) -> None:
    # Episodes 1 and 3 are slow (their env steps take 2 s): the group is 0 and 2.
    envs = [CountEnv(turns=2), CountEnv(turns=2, delay=2.0), CountEnv(turns=2), CountEnv(turns=2, delay=2.0)]
    proxy = ScriptedProxy(tokenizer)
    r = runner(tokenizer, proxy, envs, redundancy=2)
    samples = asyncio.run(r.run_group(group_id=3, prompt=SeedPrompt(index=0, seed=9), version=0, group_size=2))
    assert len(samples) == 2 and all(s.reward == 1.0 for s in samples)
    assert r.stats.cancelled_redundant == 2
    assert envs[1].closed and envs[3].closed  # cancelled episodes still close their envs


def test_failing_and_hanging_envs_are_counted_and_tolerated(tokenizer) -> None:
    # The good episodes' model calls take 0.5 s: longer than the 0.2 s step timeout that ends the
    # hanging one, so both failures are seen before the group is complete.
    envs = [CountEnv(fail=True), CountEnv(hang=True), CountEnv(turns=1), CountEnv(turns=1)]
    slow = ScriptedProxy(tokenizer, latency=lambda rid: 0.5 if ("-e2-" in rid or "-e3-" in rid) else 0.0)
    r = runner(tokenizer, slow, envs, redundancy=2, step_timeout_s=0.2)
    samples = asyncio.run(r.run_group(group_id=0, prompt=SeedPrompt(index=0, seed=1), version=0, group_size=2))
    assert len(samples) == 2
    assert r.stats.env_errors == 1 and r.stats.env_timeouts == 1 and r.stats.episodes_failed == 2


def test_too_few_episodes_drop_the_group(tokenizer) -> None:
    r = runner(tokenizer, ScriptedProxy(tokenizer), [CountEnv(fail=True), CountEnv(turns=1)])
    with pytest.raises(GroupDropped, match="only 1 of 2 episodes finished, 2 needed"):
        asyncio.run(r.run_group(group_id=0, prompt=SeedPrompt(index=0, seed=1), version=0, group_size=2))
    assert r.stats.groups_dropped == 1


def test_an_observation_beyond_the_episode_budget_ends_the_episode(tokenizer) -> None:
    r = runner(tokenizer, ScriptedProxy(tokenizer), [CountEnv(turns=5, obs_len=40)], max_episode_tokens=60)
    [s] = asyncio.run(r.run_group(group_id=0, prompt=SeedPrompt(index=0, seed=1), version=0, group_size=1))
    assert len(s.response_ids) < 60 and r.stats.truncated == 1
    assert s.response_mask[-1] == 1  # ended after the model's turn, the long observation was dropped
