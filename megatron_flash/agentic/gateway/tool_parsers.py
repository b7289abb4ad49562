"""Model output text → OpenAI message fields: content, `tool_calls`, `reasoning_content`.

Parsers are registered by name and chosen per model (`--tool-parser`, `agentic.gateway_tool_parser`).
`hermes` reads the format of Hermes and Qwen2.5/Qwen3 chat templates::

    <think>reasoning</think>            (optional, Qwen3: returned as reasoning_content)
    text                                (content)
    <tool_call>
    {"name": "calc", "arguments": {"expression": "2+3"}}
    </tool_call>                        (one block per call)

A block that is not a JSON object with a string `name` and object (or JSON-string) `arguments` does
not become a tool call: the whole output is returned as content and the failure is counted, as the
model's text is the model's answer (an agent sees what it wrote); a client that sends malformed tool
calls back gets a 400 instead (requests.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Callable, Optional


@dataclasses.dataclass
class ParsedOutput:
    content: Optional[str]
    tool_calls: list[dict]
    reasoning: Optional[str] = None
    parse_error: Optional[str] = None  # why tool-call markup was left as text


class HermesParser:
    name = "hermes"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
    _THINK = re.compile(r"^\s*<think>(.*?)</think>", re.S)

    def parse(self, text: str, *, tools_offered: bool) -> ParsedOutput:
        reasoning = None
        think = self._THINK.match(text)
        if think:
            reasoning, text = think.group(1).strip(), text[think.end():]
        if not tools_offered or "<tool_call>" not in text:
            return ParsedOutput(content=text.strip() or None, tool_calls=[], reasoning=reasoning)
        calls, error = [], None
        for i, block in enumerate(self._CALL.findall(text)):
            try:
                calls.append(_tool_call(json.loads(block)))
            except (ValueError, TypeError) as exc:
                error = f"tool call {i}: {exc}"
                break
        if error is None and text.count("<tool_call>") != len(calls):
            error = "an unclosed <tool_call> block"
        if error is not None:
            return ParsedOutput(content=text.strip() or None, tool_calls=[], reasoning=reasoning, parse_error=error)
        content = self._CALL.sub("", text).strip()
        return ParsedOutput(content=content or None, tool_calls=calls, reasoning=reasoning)


def _tool_call(obj: object) -> dict:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError("not a JSON object with a string 'name'")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("'arguments' is not a JSON object")
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args)}}


TOOL_PARSERS: dict[str, Callable[[], HermesParser]] = {"hermes": HermesParser}


def get_tool_parser(name: str) -> HermesParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()
