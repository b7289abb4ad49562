"""A calculator-tool agent written with the official `openai` client, as any agent developer would.

    agentic.workflow: megatron_flash.agentic.examples.calculator_agent:run

Per episode: ask the model the task's question with a `calc` tool offered; when it calls the tool,
evaluate the expression (the calculator environment's parser: + - * x and parentheses, never eval)
and send the result back as a tool message; when it answers (`answer: N`), that ends the episode with
reward 1.0 if N is the task's answer, else 0.0. At most `MAX_MODEL_CALLS` model calls. The agent
knows nothing about training: it talks to whatever base_url it is given.
"""

from __future__ import annotations

import asyncio
import json
import re
import weakref
from typing import Any

MAX_MODEL_CALLS = 3
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "evaluate an integer arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
_ANSWER = re.compile(r"answer:\s*([+-]?\d+)")
_HTTP: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any]" = weakref.WeakKeyDictionary()


def http_client() -> Any:
    """One connection pool for every episode on this event loop. A new AsyncOpenAI makes its own, and
    building its TLS context (~50 ms of CPU, for a plain-http URL too) blocks the loop the episodes share:
    64 episodes starting together kept the engines idle for seconds (tokens_per_s 0 in those steps)."""
    from openai import DefaultAsyncHttpxClient

    loop = asyncio.get_running_loop()
    client = _HTTP.get(loop)
    if client is None or client.is_closed:
        client = _HTTP[loop] = DefaultAsyncHttpxClient()
    return client


def calc(arguments: str) -> str:
    from megatron_flash.agentic.envs.calculator import CalcError, evaluate

    try:
        expression = json.loads(arguments).get("expression", "")
        return str(evaluate(str(expression)))
    except (ValueError, AttributeError, CalcError) as error:
        return f"error: {error}"


async def run(base_url: str, api_key: str, task: dict) -> tuple[float, dict]:
    from openai import AsyncOpenAI

    # The shared pool outlives the episode: closing this client would close it for every other one.
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http_client())
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["text"]}]
    tool_calls = 0
    for _ in range(MAX_MODEL_CALLS):
        reply = await client.chat.completions.create(model=task.get("model", "policy"), messages=messages,
                                                     tools=TOOLS, max_tokens=48)
        message = reply.choices[0].message
        if message.tool_calls:
            messages.append({"role": "assistant", "content": message.content,
                             "tool_calls": [call.model_dump() for call in message.tool_calls]})
            for call in message.tool_calls:
                tool_calls += 1
                messages.append({"role": "tool", "tool_call_id": call.id, "content": calc(call.function.arguments)})
            continue
        found = _ANSWER.search(message.content or "")
        correct = found is not None and found.group(1) == str(task["answer"])
        return (1.0 if correct else 0.0), {"success": correct, "tool_calls": tool_calls}
    return 0.0, {"success": False, "tool_calls": tool_calls}
