"""Why the agent-gateway quickstart's progress bar read tokens_per_s=0, and the two fixes.

1. The calculator agent built a fresh `AsyncOpenAI` per episode; each builds its own httpx pool and TLS
   context (~50 ms of CPU, for a plain-http URL too) on the rollout loop that every episode shares, so a
   step's 64 episodes blocked that loop for seconds: no request reached an engine (engine_idle_frac 1.0,
   0 tokens) in every other step. Now every episode on a loop shares one pool.
2. The workflow runner counted an episode's tokens when the episode ended, so a window in which engines
   generated but no episode finished still read 0. Now each engine reply is counted as it arrives, as
   for single-turn rollout.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import openai

from megatron_flash.agentic.examples import calculator_agent
from megatron_flash.agentic.workflow import _Backend
from megatron_flash.rollout.scheduler import RolloutStats


class FakeOpenAI:
    made: list["FakeOpenAI"] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        FakeOpenAI.made.append(self)
        message = SimpleNamespace(tool_calls=None, content="answer: 5")
        reply = SimpleNamespace(choices=[SimpleNamespace(message=message)])

        async def create(**_: object) -> object:
            await asyncio.sleep(0)
            return reply

        self.chat = SimpleNamespace(completions=SimpleNamespace(create=create))


def test_episodes_on_one_loop_share_one_connection_pool(monkeypatch) -> None:
    monkeypatch.setattr(openai, "AsyncOpenAI", FakeOpenAI)
    FakeOpenAI.made = []

    async def episodes() -> list:
        task = {"text": "2+3=?", "answer": "5", "model": "policy"}
        return await asyncio.gather(*(calculator_agent.run(f"http://127.0.0.1:1/sessions/e{i}/v1", "key", task)
                                      for i in range(3)))

    first = asyncio.run(episodes())
    assert [r[0] for r in first] == [1.0, 1.0, 1.0]
    pools = {id(c.kwargs["http_client"]) for c in FakeOpenAI.made}
    assert len(FakeOpenAI.made) == 3 and len(pools) == 1
    assert not FakeOpenAI.made[0].kwargs["http_client"].is_closed  # an episode's end leaves it to the others
    asyncio.run(episodes())  # a new loop gets its own pool (a pool is bound to the loop that opened it)
    assert len({id(c.kwargs["http_client"]) for c in FakeOpenAI.made}) == 2


def test_every_engine_reply_is_counted_when_it_arrives() -> None:
    class Proxy:
        async def generate(self, input_ids, params, *, rid):
            return SimpleNamespace(output_ids=[7] * params["max_new_tokens"])

    runner = SimpleNamespace(rollout_stats=None)
    backend = _Backend(Proxy(), {"temperature": 1.0, "top_p": None}, runner)

    async def turns() -> None:
        await backend.generate([1, 2], {"max_new_tokens": 3}, rid="a")
        runner.rollout_stats = RolloutStats()  # set by the runtime once the scheduler exists
        await backend.generate([1, 2], {"max_new_tokens": 3}, rid="b")
        await backend.generate([1, 2], {"max_new_tokens": 5}, rid="c")

    asyncio.run(turns())
    assert (runner.rollout_stats.requests, runner.rollout_stats.tokens_generated) == (2, 8)
