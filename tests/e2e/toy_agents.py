"""Agent workflows for the e2e tests (agentic.workflow=tests.e2e.toy_agents:...), written with the
official `openai` client like any user's agent.

`two_turns_flaky`: two model calls per episode (the second sends back the first reply and a tool
result, as a tool-using agent does); the reward is the fraction of digits in the replies (a random
tiny model never answers correctly, and rewards must vary for anything to train). Episodes are
numbered in the order they start in this process: every 7th hangs (the run's per-episode timeout
must end it), every 11th raises; the run must count both and go on.
"""

from __future__ import annotations

import asyncio
import itertools

_started = itertools.count(1)


async def two_turns_flaky(base_url: str, api_key: str, task: dict) -> tuple[float, dict]:
    from openai import AsyncOpenAI

    n = next(_started)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    try:
        messages = [{"role": "user", "content": task["text"]}]
        first = await client.chat.completions.create(model="any-name", messages=messages, max_tokens=6)
        if n % 7 == 0:
            await asyncio.sleep(3600)
        if n % 11 == 0:
            raise RuntimeError(f"toy agent episode {n} fails on purpose")
        messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                     {"role": "user", "content": "12"}]
        second = await client.chat.completions.create(model="any-name", messages=messages, max_tokens=6)
        text = (first.choices[0].message.content or "") + (second.choices[0].message.content or "")
        return sum(c.isdigit() for c in text) / max(len(text), 1), {"success": False}
    finally:
        await client.close()
