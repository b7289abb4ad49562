"""The gateway's HTTP face, OpenAI's shapes: `POST /v1/chat/completions` (stream false and true),
`GET /v1/models`, and `GET /v1/trajectories/{session}` (the recorded tokens of a session).

Sessions: the `X-Session-Id` header, else the body's `user` field, else a fresh id per request; the
reply carries it back in `X-Session-Id`. The same routes under `/sessions/{session}/v1/...` name the
session in the path instead: a run gives each agent episode such a base URL, so any client works
unchanged. With an API key every route but /health needs
`Authorization: Bearer KEY` (OpenAI's 401 otherwise).

Streaming sends the turn as OpenAI chunks once the engine has finished it (role, reasoning, content,
tool calls, finish reason, usage with `stream_options.include_usage`, then `[DONE]`): the tokens are
recorded per turn, and an aborted-and-resumed turn is only final at its end.

(No `from __future__ import annotations` here: FastAPI reads the route signatures' types at runtime.)
"""


import hmac
import json
import uuid
from typing import Any, AsyncIterator, Optional

from megatron_flash.agentic.gateway.core import GatewayCore, TurnResult
from megatron_flash.agentic.gateway.requests import RequestError, parse_chat_request

SESSION_HEADER = "X-Session-Id"


def _message(turn: TurnResult) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": turn.parsed.content}
    if turn.parsed.tool_calls:
        message["tool_calls"] = turn.parsed.tool_calls
    if turn.parsed.reasoning is not None:
        message["reasoning_content"] = turn.parsed.reasoning
    return message


def _usage(turn: TurnResult) -> dict:
    return {"prompt_tokens": turn.prompt_tokens, "completion_tokens": turn.completion_tokens,
            "total_tokens": turn.prompt_tokens + turn.completion_tokens}


def completion_body(turn: TurnResult, model: str) -> dict:
    return {"id": turn.completion_id, "object": "chat.completion", "created": turn.created, "model": model,
            "choices": [{"index": 0, "message": _message(turn), "logprobs": None, "finish_reason": turn.finish_reason}],
            "usage": _usage(turn)}


def stream_chunks(turn: TurnResult, model: str, include_usage: bool) -> list[dict]:
    def chunk(delta: dict, finish: Optional[str] = None) -> dict:
        return {"id": turn.completion_id, "object": "chat.completion.chunk", "created": turn.created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    out = [chunk({"role": "assistant", "content": ""})]
    if turn.parsed.reasoning is not None:
        out.append(chunk({"reasoning_content": turn.parsed.reasoning}))
    if turn.parsed.content:
        out.append(chunk({"content": turn.parsed.content}))
    for i, call in enumerate(turn.parsed.tool_calls):
        out.append(chunk({"tool_calls": [{"index": i, **call}]}))
    out.append(chunk({}, turn.finish_reason))
    if include_usage:
        out.append({"id": turn.completion_id, "object": "chat.completion.chunk", "created": turn.created,
                    "model": model, "choices": [], "usage": _usage(turn)})
    return out


def build_app(core: GatewayCore, *, api_key: Optional[str] = None) -> Any:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="megatron-flash agent gateway")
    app.state.core = core

    def error(err: RequestError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.middleware("http")
    async def auth(request: Request, call_next: Any) -> Any:
        if api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error(RequestError("Incorrect API key provided", status=401, code="invalid_api_key"))
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    @app.get("/v1/models")
    @app.get("/sessions/{session_id}/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": core.model_name, "object": "model", "created": 0,
                                            "owned_by": "megatron-flash"}]}

    @app.get("/v1/trajectories/{session_id}")
    async def trajectory(session_id: str) -> Any:
        session = core.sessions.get(session_id)
        if session is None:
            return error(RequestError(f"no session {session_id!r}", param="session", status=404,
                                      code="session_not_found"))
        return session.to_json()

    @app.post("/v1/chat/completions")
    @app.post("/sessions/{path_session}/v1/chat/completions")
    async def chat(request: Request, path_session: Optional[str] = None) -> Any:
        try:
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError):
                raise RequestError("the request body is not valid JSON") from None
            chat_request = parse_chat_request(body, served_model=None if core.any_model else core.model_name,
                                              default_max_tokens=core.default_max_tokens)
            session_id = (path_session or request.headers.get(SESSION_HEADER) or chat_request.user
                          or f"s-{uuid.uuid4().hex}")
            if core.closed_sessions is not None and session_id in core.closed_sessions:
                raise RequestError(f"session {session_id!r} has ended (its episode finished or was cancelled)",
                                   param="session", status=409, code="session_closed")
            turn = await core.chat(chat_request, session_id)
        except RequestError as err:
            core.stats.request_errors += 1
            return error(err)
        headers = {SESSION_HEADER: session_id}
        if not chat_request.stream:
            return JSONResponse(completion_body(turn, chat_request.model), headers=headers)

        async def events() -> AsyncIterator[bytes]:
            for chunk in stream_chunks(turn, chat_request.model, chat_request.include_usage):
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    return app
