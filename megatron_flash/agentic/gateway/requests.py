"""`POST /v1/chat/completions` bodies checked into a `ChatRequest`; every refusal is a `RequestError`
that the server answers in OpenAI's error shape, naming the offending field (`param`).

Sampling fields map to SGLang's sampling params (temperature, top_p, max_tokens or
max_completion_tokens → max_new_tokens, stop, presence/frequency_penalty, seed → sampling_seed).
Fields agent frameworks send that change nothing here (parallel_tool_calls, store, metadata, user,
stream_options other than include_usage, logprobs=false, n=1) are accepted; any other unknown field
is refused as OpenAI does ("Unrecognized request argument supplied").
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

ROLES = ("system", "developer", "user", "assistant", "tool")
SAMPLING = ("temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "presence_penalty",
            "frequency_penalty", "seed")
ACCEPTED = {"model", "messages", "tools", "tool_choice", "stream", "stream_options", "n", "user", "store",
            "metadata", "parallel_tool_calls", "logprobs"} | set(SAMPLING)


class RequestError(ValueError):
    def __init__(self, message: str, *, param: Optional[str] = None, status: int = 400,
                 code: Optional[str] = None, err_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.err_type = message, param, status, code, err_type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}


@dataclasses.dataclass
class ChatRequest:
    model: str
    messages: list[dict]
    tools: Optional[list[dict]]
    sampling: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    user: Optional[str] = None


def _number(body: dict, key: str, lo: float, hi: float) -> Optional[float]:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise RequestError(f"'{key}' must be a number in [{lo}, {hi}], got {value!r}", param=key)
    return float(value)


def _text(content: Any, where: str) -> Optional[str]:
    """Message content as text: a string, or a list of {"type": "text", "text"} parts joined."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}[{i}] must be a text part {{'type': 'text', 'text': ...}} "
                                   "(images and audio are not supported)", param=f"{where}[{i}]")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where} must be a string or a list of text parts", param=where)


def _message(i: int, m: Any) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise RequestError(f"{where} must be an object", param=where)
    role = m.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role,
                           "content": _text(m.get("content"), f"{where}.content")}
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise RequestError(f"{where}.tool_call_id is required for role 'tool'", param=f"{where}.tool_call_id")
        out["tool_call_id"] = m["tool_call_id"]
    if role == "assistant" and m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise RequestError(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
        out["tool_calls"] = [_sent_tool_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
    elif out["content"] is None:
        raise RequestError(f"{where}.content is required", param=f"{where}.content")
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def _sent_tool_call(where: str, call: Any) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f"{where}.function.name is required", param=f"{where}.function.name")
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except (TypeError, ValueError) as error:
        raise RequestError(f"{where}.function.arguments is not valid JSON: {error}",
                           param=f"{where}.function.arguments") from None
    if not isinstance(args, dict):
        raise RequestError(f"{where}.function.arguments must encode a JSON object", param=f"{where}.function.arguments")
    # Chat templates (Qwen's among them) render arguments as a mapping.
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _tools(body: dict) -> Optional[list[dict]]:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list", param="tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise RequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param=f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"tools[{i}].function.name is required", param=f"tools[{i}].function.name")
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON Schema object",
                               param=f"tools[{i}].function.parameters")
    return tools


def parse_chat_request(body: Any, *, served_model: Optional[str], default_max_tokens: int) -> ChatRequest:
    """`served_model` None: any `model` name is served (a run serves its policy under every name)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = sorted(set(body) - ACCEPTED)
    if unknown:
        raise RequestError(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise RequestError("'model' is required", param="model")
    if served_model is not None and body["model"] != served_model:
        raise RequestError(f"The model {body.get('model')!r} does not exist; this gateway serves {served_model!r}",
                           param="model", status=404, code="model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    parsed = [_message(i, m) for i, m in enumerate(messages)]
    tools = _tools(body)
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise RequestError("tool_choice must be 'auto' or 'none' (forcing a call needs constrained decoding, "
                           f"which the gateway does not do), got {choice!r}", param="tool_choice")
    if choice == "none":
        tools = None
    if body.get("n", 1) != 1:
        raise RequestError(f"n must be 1 (one completion per request), got {body['n']!r}", param="n")
    if body.get("logprobs") not in (None, False):
        raise RequestError("logprobs are recorded in the trajectory (GET /v1/trajectories/{session}), not returned",
                           param="logprobs")
    sampling: dict[str, Any] = {}
    for key, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0), ("presence_penalty", -2.0, 2.0),
                        ("frequency_penalty", -2.0, 2.0)):
        value = _number(body, key, lo, hi)
        if value is not None:
            sampling[key] = value
    if sampling.get("top_p") == 0.0:
        raise RequestError("'top_p' must be > 0", param="top_p")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        raise RequestError(f"'{key}' must be a positive integer, got {max_tokens!r}", param=key)
    sampling["max_new_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
            raise RequestError("'stop' must be a string or a list of up to 4 non-empty strings", param="stop")
        sampling["stop"] = stops
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise RequestError(f"'seed' must be an integer, got {seed!r}", param="seed")
        sampling["sampling_seed"] = seed
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    user = body.get("user")
    return ChatRequest(model=body["model"], messages=parsed, tools=tools, sampling=sampling, stream=stream,
                       include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
                       user=user if isinstance(user, str) and user else None)
