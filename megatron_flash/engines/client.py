"""Async HTTP client for ONE engine speaking SGLang's native API (0.5.23 JSON, field for field).

Our local engine server speaks the same contract, so this client serves both. What it relies on
(paths into sglang 0.5.23's `python/sglang/`):

  POST /generate            {"input_ids", "sampling_params", "return_logprob", "rid"} →
                            {"text", "output_ids", "meta_info": {"id", "finish_reason",
                            "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
                            ["weight_versions": [{"version", "start", "end"}]],
                            ["output_token_logprobs": [[logprob, token_id, text|null], ...]]}}
                            (srt/managers/tokenizer_manager.py, meta_info built at 2507-2558;
                            a user abort answers 200 with finish_reason {"type": "abort", ...}, 3597-3627)
  POST /generate, one prompt, sampling_params.n > 1 → a JSON list of n such objects. Each sample gets
                            a fresh uuid4 rid (tokenizer_manager.py 2174, regenerate_rid) and the
                            request's own rid state is dropped (2159), so /abort_request with that
                            rid is a no-op (2252); abort_all and a closed connection do abort them.
  finish_reason             {"type": "stop", "matched": int|str|list} | {"type": "length", "length": n}
                            | {"type": "abort", "message", "status_code", "err_type"}
                            (srt/managers/schedule_batch.py 284-345)
  POST /abort_request       {"rid", "abort_all"} → 200, empty body   (srt/entrypoints/http_server.py 1721)
  POST /pause_generation    {"mode": abort|retract|in_place}; POST /continue_generation {}   (1831, 1844)
  GET|POST /flush_cache     200 text, or 400 text while requests run                          (1025)
  POST /update_weights_from_{tensor,distributed,disk}, /init_weights_update_group,
       /begin_weight_update, /end_weight_update → {"success": bool, "message": str}, 400 when not
       success (1300-1506). Tensor and distributed updates are refused outside a
       begin…end session (srt/managers/scheduler_components/weight_updater.py 193, 235).
  GET /health → 200 | 503;  GET /model_info → {..., "weight_version"} (there is no
       /get_weight_version in 0.5.23)                                                        (721, 812)

Errors are typed (``EngineError`` and subclasses) and name the URL, the endpoint and the field.
Only idempotent calls (health, model_info, get_weight_version, flush_cache) are retried, with
exponential backoff; generate and weight updates are never retried here (the proxy decides).

`EngineClient` is put together from one module per concern; this module re-exports their public names:

  client_base.py        the errors, the HTTP exchange and its retries (`EngineTransport`)
  client_replies.py     `GenerateResult`, `version_number`, `parse_generate_reply` (the /generate contract)
  client_generation.py  generate, generate_n, score, abort, pause / continue, flush_cache
  client_weights.py     weight-update sessions and updates, release / resume of engine memory
  client.py             `EngineClient`: its constructor and the probes (health, model_info, server_info)
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import aiohttp

from megatron_flash.engines.client_base import (EngineError, EngineHTTPError, EngineTimeout, EngineUnreachable,
                                                 MalformedReply, short_repr)
from megatron_flash.engines.client_generation import PAUSE_MODES, GenerationCalls
from megatron_flash.engines.client_replies import (FINISH_TYPES, INITIAL_WEIGHT_VERSION, GenerateResult,
                                                   WeightVersionSpan, parse_generate_reply, version_number)
from megatron_flash.engines.client_weights import SESSION_MODES, WeightUpdateCalls

__all__ = [
    "EngineClient", "EngineError", "EngineHTTPError", "EngineTimeout", "EngineUnreachable", "MalformedReply",
    "GenerateResult", "WeightVersionSpan", "INITIAL_WEIGHT_VERSION", "version_number", "parse_generate_reply",
    "FINISH_TYPES", "PAUSE_MODES", "SESSION_MODES",
]


class EngineClient(GenerationCalls, WeightUpdateCalls):
    """One engine server. Create inside a running event loop's lifetime; ``await close()`` at the end.

    Timeouts: ``request_timeout_s`` bounds generate and weight updates (which can legitimately take
    minutes), ``control_timeout_s`` bounds everything else; every method takes ``timeout_s`` to
    override. Retries (``max_retries`` extra attempts, backoff ``retry_backoff_s`` × 2^k capped at
    ``retry_backoff_max_s``) apply to idempotent calls only, on unreachable/timeout and 5xx.

    ``weight_update_session``: SGLang 0.5.23 refuses tensor/distributed updates outside
    /begin_weight_update … /end_weight_update. ``auto`` opens the session and, on a 404 (a server
    without those endpoints, e.g. older SGLang), remembers not to try again; ``always`` requires it;
    ``never`` skips it. Updates made inside ``async with client.weight_update_session():`` share one
    session (one begin/end for all buckets); an update outside one gets its own begin/end.
    """

    def __init__(self, url: str, *, api_key: Optional[str] = None, request_timeout_s: float = 600.0,
                 control_timeout_s: float = 60.0, max_retries: int = 3, retry_backoff_s: float = 0.2,
                 retry_backoff_max_s: float = 5.0, weight_update_session: str = "auto") -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine url must start with http:// or https://, got {url!r}")
        if weight_update_session not in SESSION_MODES:
            raise ValueError(f"weight_update_session must be one of {'|'.join(SESSION_MODES)}, "
                             f"got {weight_update_session!r}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.retry_backoff_max_s = retry_backoff_max_s
        self.weight_update_session_mode = weight_update_session
        self._server_has_session: Optional[bool] = None if weight_update_session == "auto" else (
            weight_update_session == "always")
        self._session_state: Optional[str] = None  # None | "server" | "local"
        self._http: Optional[aiohttp.ClientSession] = None

    def __repr__(self) -> str:
        return f"EngineClient({self.url!r})"

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- probes -------------------------------------------------------------------------------
    async def health(self, *, timeout_s: Optional[float] = None, retries: Optional[int] = None) -> None:
        """Raise EngineError unless GET /health answers 200 (503 while starting or unhealthy)."""
        await self._call_idempotent("GET", "/health", timeout_s=timeout_s or self.control_timeout_s,
                                    retries=retries, expect_json=False)

    async def is_healthy(self, *, timeout_s: Optional[float] = None) -> bool:
        """One /health probe, no retries, never raises."""
        try:
            await self.health(timeout_s=timeout_s, retries=0)
        except EngineError:
            return False
        return True

    async def model_info(self, *, timeout_s: Optional[float] = None) -> Dict[str, Any]:
        reply = await self._call_idempotent("GET", "/model_info", timeout_s=timeout_s or self.control_timeout_s)
        if not isinstance(reply, dict):
            raise MalformedReply(self.url, "/model_info", "<body>",
                                 f"reply is not a JSON object (got {short_repr(reply)})")
        return reply

    async def server_info(self, *, timeout_s: Optional[float] = None) -> Dict[str, Any]:
        reply = await self._call_idempotent("GET", "/get_server_info", timeout_s=timeout_s or self.control_timeout_s)
        if not isinstance(reply, dict):
            raise MalformedReply(self.url, "/get_server_info", "<body>",
                                 f"reply is not a JSON object (got {short_repr(reply)})")
        return reply

    async def get_weight_version(self, *, timeout_s: Optional[float] = None) -> str:
        """The engine's current weight version, read from /model_info's weight_version."""
        info = await self.model_info(timeout_s=timeout_s)
        if info.get("weight_version") is None:
            raise MalformedReply(self.url, "/model_info", "weight_version",
                                 "reply lacks weight_version")
        return str(info["weight_version"])
