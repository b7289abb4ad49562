"""Async HTTP client for ONE engine speaking SGLang's native API (0.5.23 JSON, field for field).

Our CPU engine server speaks the same contract, so this client serves both. What it relies on
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
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Mapping, Optional, Sequence, Union

import aiohttp

from megatron_flash.types import decode_routes

FINISH_TYPES = ("stop", "length", "abort")
PAUSE_MODES = ("abort", "retract", "in_place")
SESSION_MODES = ("auto", "always", "never")


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------
class EngineError(RuntimeError):
    """A call to an engine failed; ``str()`` names the engine URL and the endpoint."""

    def __init__(self, url: str, endpoint: str, detail: str) -> None:
        self.url = url
        self.endpoint = endpoint
        self.detail = detail
        super().__init__(f"{url}{endpoint}: {detail}")


class EngineUnreachable(EngineError):
    """No reply: connection refused/reset, server gone mid-request. The engine may be dead."""


class EngineTimeout(EngineUnreachable):
    """No reply within the call's timeout. Treated as unreachable (the engine may be hung)."""


class EngineHTTPError(EngineError):
    """The engine answered with an error status, or with ``"success": false``."""

    def __init__(self, url: str, endpoint: str, status: int, body: str) -> None:
        self.status = status
        self.body = body
        super().__init__(url, endpoint, f"HTTP {status}: {body[:1000]}")


class MalformedReply(EngineError):
    """The reply does not follow SGLang's JSON contract; ``field`` names the offending field."""

    def __init__(self, url: str, endpoint: str, field: str, detail: str) -> None:
        self.field = field
        super().__init__(url, endpoint, detail)


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightVersionSpan:
    """Output tokens [start, end) were sampled under weight ``version`` (SGLang ``weight_versions``)."""

    version: str
    start: int
    end: int


@dataclass
class GenerateResult:
    """One finished (or aborted) generation, parsed from SGLang's /generate reply."""

    rid: str
    output_ids: List[int]
    output_logprobs: Optional[List[float]]
    """Behavior logprob log μ of each output token (``meta_info.output_token_logprobs[i][0]``);
    None when asked with return_logprob=False."""
    finish_reason: str
    """stop | length | abort."""
    finish_matched: Union[int, str, List[int], None] = None
    """The stop token/string that ended a ``stop`` finish (None for eos-less stops and others)."""
    finish_message: Optional[str] = None
    """Why an ``abort`` happened, as the engine (or the proxy) says."""
    weight_version: Optional[str] = None
    """``meta_info.weight_version``: the engine's weight version when the reply was built."""
    weight_version_spans: Optional[List[WeightVersionSpan]] = None
    """Per-token-range versions when the engine reports them (weights changed mid-generation)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    engine_url: str = ""
    """The engine that produced this result ("" for a request the proxy aborted before dispatch)."""
    meta_info: Dict[str, Any] = field(default_factory=dict, repr=False)
    """The raw meta_info, for fields this class does not lift (timings, retractions, ...)."""
    routed_experts: Any = None
    """MoE routes (``meta_info.routed_experts``, asked with return_routed_experts): a tensor
    [prompt + completion - 1, layers * top_k] of expert ids; None when not asked or not returned."""

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"

    def span_versions(self) -> Optional[List[Optional[int]]]:
        """Per output token, the (integer) weight version of the span it falls in, when the engine's
        spans cover every token; None otherwise (non-integer versions become None)."""
        if not self.weight_version_spans:
            return None
        out: List[Optional[int]] = []
        for span in self.weight_version_spans:
            out += [version_number(span.version)] * (span.end - span.start)
        return out if len(out) == len(self.output_ids) else None

    @property
    def min_weight_version(self) -> Optional[str]:
        """The oldest version any output token was sampled under (staleness is counted from it)."""
        if self.weight_version_spans:
            return self.weight_version_spans[0].version
        return self.weight_version


INITIAL_WEIGHT_VERSION = "default"
"""SGLang's label of the weights an engine started with (--weight-version's default)."""


def version_number(value: Any) -> Optional[int]:
    """A weight version label as the policy version it names (runs label versions 0, 1, …), else None.
    SGLang's initial label names version 0: an engine serves its start checkpoint (model.hf_path) only
    in a fresh run before the first push — a resumed run, and an engine restarted mid-run, are
    re-synced (and so re-labelled) before they serve."""
    if value == INITIAL_WEIGHT_VERSION:
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def parse_generate_reply(reply: Any, *, url: str, rid: str, input_len: int,
                         return_logprob: bool, endpoint: str = "/generate",
                         return_routed_experts: bool = False) -> GenerateResult:
    """Check one non-streaming /generate reply against the contract and lift it into a result."""

    def bad(name: str, detail: str) -> MalformedReply:
        return MalformedReply(url, endpoint, name, detail)

    if not isinstance(reply, dict):
        raise bad("<body>", f"reply is a {type(reply).__name__}, expected a JSON object "
                            "(one prompt per request)")
    output_ids = reply.get("output_ids")
    if not isinstance(output_ids, list) or not all(_is_int(t) for t in output_ids):
        raise bad("output_ids", f"reply lacks output_ids as a list of ints (got {_short(output_ids)})")
    meta = reply.get("meta_info")
    if not isinstance(meta, dict):
        raise bad("meta_info", f"reply lacks meta_info (got {_short(meta)})")

    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") not in FINISH_TYPES:
        raise bad("meta_info.finish_reason", "meta_info.finish_reason must be an object with type in "
                  f"{'|'.join(FINISH_TYPES)} (got {_short(finish)})")

    version = meta.get("weight_version")
    if version is None:
        raise bad("meta_info.weight_version", "reply lacks meta_info.weight_version")
    spans = None
    if meta.get("weight_versions") is not None:
        spans = _parse_spans(meta["weight_versions"], bad)

    logprobs = None
    if return_logprob:
        entries = meta.get("output_token_logprobs")
        if entries is None:
            raise bad("meta_info.output_token_logprobs", "reply lacks meta_info.output_token_logprobs "
                      "(asked with return_logprob=true)")
        if not isinstance(entries, list) or len(entries) != len(output_ids):
            raise bad("meta_info.output_token_logprobs",
                      f"meta_info.output_token_logprobs has {_len(entries)} entries for "
                      f"{len(output_ids)} output_ids")
        logprobs = []
        for i, (entry, token) in enumerate(zip(entries, output_ids)):
            # Each entry is SGLang's (logprob, token_id, text|None) tuple, a list in JSON.
            if (not isinstance(entry, (list, tuple)) or len(entry) < 2 or not _is_number(entry[0])
                    or not _is_int(entry[1])):
                raise bad(f"meta_info.output_token_logprobs[{i}]",
                          f"meta_info.output_token_logprobs[{i}] must be [logprob, token_id, text], "
                          f"got {_short(entry)}")
            if entry[1] != token:
                raise bad(f"meta_info.output_token_logprobs[{i}]",
                          f"meta_info.output_token_logprobs[{i}] is for token {entry[1]} but "
                          f"output_ids[{i}] is {token}")
            logprobs.append(float(entry[0]))

    counts = {}
    for name, default in (("prompt_tokens", input_len), ("completion_tokens", len(output_ids)),
                          ("cached_tokens", 0)):
        # SGLang omits prompt_tokens and cached_tokens on a request aborted while still waiting
        # (tokenizer_manager.py 3602-3628): the defaults are what they must be then.
        value = meta.get(name, default)
        if not _is_int(value):
            raise bad(f"meta_info.{name}", f"meta_info.{name} must be an int, got {_short(value)}")
        counts[name] = int(value)

    routes = None
    raw_routes = meta.get("routed_experts") if return_routed_experts else None
    if raw_routes is not None:
        rows = counts["prompt_tokens"] + counts["completion_tokens"] - 1
        if not isinstance(raw_routes, str):
            raise bad("meta_info.routed_experts", f"meta_info.routed_experts must be a base64 string, got "
                      f"{_short(raw_routes)}")
        try:
            routes = decode_routes(raw_routes, rows)
        except ValueError as error:  # binascii.Error is a ValueError
            raise bad("meta_info.routed_experts", f"meta_info.routed_experts: {error}") from error

    text = reply.get("text", "")
    return GenerateResult(
        rid=str(meta.get("id", rid)), output_ids=[int(t) for t in output_ids], output_logprobs=logprobs,
        finish_reason=finish["type"], finish_matched=finish.get("matched"),
        finish_message=finish.get("message"), weight_version=str(version),
        weight_version_spans=spans, text=text if isinstance(text, str) else "", engine_url=url,
        meta_info=meta, routed_experts=routes, **counts)


def _parse_spans(raw: Any, bad) -> List[WeightVersionSpan]:
    if not isinstance(raw, list):
        raise bad("meta_info.weight_versions", f"meta_info.weight_versions must be a list, got {_short(raw)}")
    spans = []
    for i, span in enumerate(raw):
        if (not isinstance(span, dict) or "version" not in span or not _is_int(span.get("start"))
                or not _is_int(span.get("end"))):
            raise bad(f"meta_info.weight_versions[{i}]", f"meta_info.weight_versions[{i}] must be "
                      f"{{version, start, end}}, got {_short(span)}")
        spans.append(WeightVersionSpan(str(span["version"]), int(span["start"]), int(span["end"])))
    return spans


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and not math.isnan(x)


def _len(x: Any) -> str:
    return str(len(x)) if isinstance(x, list) else f"no list ({type(x).__name__})"


def _short(x: Any, limit: int = 120) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[:limit] + "…"


# ---------------------------------------------------------------------------------------------
# Client
# ---------------------------------------------------------------------------------------------
class EngineClient:
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

    async def close(self) -> None:
        if self._http is not None and not self._http.closed:
            await self._http.close()
        self._http = None

    # -- transport --------------------------------------------------------------------------
    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            # The proxy bounds concurrency per engine; the connector must not add a second limit.
            self._http = aiohttp.ClientSession(headers=headers,
                                               connector=aiohttp.TCPConnector(limit=0))
        return self._http

    async def _call(self, method: str, endpoint: str, *, body: Optional[Mapping[str, Any]] = None,
                    timeout_s: float, expect_json: bool = True) -> Any:
        """One HTTP exchange. Returns parsed JSON (or text when ``expect_json`` is False)."""
        try:
            async with self._session().request(
                    method, self.url + endpoint, json=body,
                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                raw = await resp.read()
                status = resp.status
        except asyncio.TimeoutError as e:
            raise EngineTimeout(self.url, endpoint, f"no reply within {timeout_s:g}s") from e
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError) as e:
            raise EngineUnreachable(self.url, endpoint, f"cannot reach the engine "
                                                        f"({type(e).__name__}: {e})") from e
        text = raw.decode("utf-8", errors="replace")
        if status >= 400:
            raise EngineHTTPError(self.url, endpoint, status, text)
        if not expect_json:
            return text
        if not raw:
            return None
        try:
            return json.loads(text)
        except ValueError as e:
            raise MalformedReply(self.url, endpoint, "<body>",
                                 f"reply is not JSON ({e}): {_short(text)}") from e

    async def _call_idempotent(self, method: str, endpoint: str, *, timeout_s: float,
                               retries: Optional[int] = None, **kw: Any) -> Any:
        retries = self.max_retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                return await self._call(method, endpoint, timeout_s=timeout_s, **kw)
            except (EngineUnreachable, EngineHTTPError) as e:
                transient = isinstance(e, EngineUnreachable) or e.status >= 500
                if not transient or attempt == retries:
                    raise
                await asyncio.sleep(min(self.retry_backoff_s * 2 ** attempt, self.retry_backoff_max_s))
        raise AssertionError("unreachable")

    def _success(self, endpoint: str, reply: Any) -> Dict[str, Any]:
        """Weight-update style replies: {"success": bool, "message": str}; success=false raises."""
        if not isinstance(reply, dict) or not isinstance(reply.get("success"), bool):
            raise MalformedReply(self.url, endpoint, "success",
                                 f"reply lacks a boolean success field (got {_short(reply)})")
        if not reply["success"]:
            raise EngineHTTPError(self.url, endpoint, 200, json.dumps(reply))
        return reply

    # -- generation ---------------------------------------------------------------------------
    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any], *,
                       return_logprob: bool = True, rid: Optional[str] = None,
                       timeout_s: Optional[float] = None, return_routed_experts: bool = False) -> GenerateResult:
        """One prompt → one completion. Never retried here. ``rid`` defaults to a fresh uuid.
        ``return_routed_experts`` asks a MoE engine for its routes (SGLang needs
        ``--enable-return-routed-experts``; the field is only sent when asked)."""
        rid = rid or uuid.uuid4().hex
        body = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params),
                "return_logprob": return_logprob, "rid": rid}
        if return_routed_experts:
            body["return_routed_experts"] = True
        reply = await self._call("POST", "/generate", body=body,
                                 timeout_s=timeout_s or self.request_timeout_s)
        return parse_generate_reply(reply, url=self.url, rid=rid, input_len=len(body["input_ids"]),
                                    return_logprob=return_logprob, return_routed_experts=return_routed_experts)

    async def score(self, batch_input_ids: Sequence[Sequence[int]], *, logprob_start_len: int,
                    timeout_s: Optional[float] = None) -> Any:
        """Teacher-forced input logprobs of a batch of sequences: one /generate with
        `max_new_tokens` 1 from `logprob_start_len`. Returns SGLang's reply as is (a list, one item
        per sequence, each with `meta_info.input_token_logprobs`); the caller checks it."""
        body = {"input_ids": [list(ids) for ids in batch_input_ids], "return_logprob": True,
                "logprob_start_len": logprob_start_len,
                "sampling_params": {"max_new_tokens": 1, "temperature": 1.0}}
        return await self._call("POST", "/generate", body=body, timeout_s=timeout_s or self.request_timeout_s)

    async def generate_n(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any], n: int, *,
                         return_logprob: bool = True, rid: Optional[str] = None,
                         timeout_s: Optional[float] = None,
                         return_routed_experts: bool = False) -> List[GenerateResult]:
        """One prompt → ``n`` completions in one request (SGLang parallel sampling, ``sampling_params.n``).

        SGLang answers a JSON list of n reply objects, each parsed like ``generate``'s. Each result's
        ``rid`` is the engine's ``meta_info.id``: SGLang 0.5.23 gives every sample a fresh uuid (not
        derived from ``rid``), the CPU engine ``f"{rid}_{i}"``. ``abort(rid)`` with the request's rid
        ends all n on the CPU engine but is a no-op on SGLang 0.5.23 (see docs/engines_client.md).
        n = 1 is a plain ``generate`` (SGLang then answers one object, not a list). Never retried here.
        """
        if not _is_int(n) or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        if sampling_params.get("n", n) not in (n, None):
            raise ValueError(f"sampling_params.n={sampling_params['n']!r} contradicts n={n}")
        if n == 1:
            params = {k: v for k, v in sampling_params.items() if k != "n"}
            return [await self.generate(input_ids, params, return_logprob=return_logprob, rid=rid,
                                        timeout_s=timeout_s, return_routed_experts=return_routed_experts)]
        rid = rid or uuid.uuid4().hex
        body = {"input_ids": list(input_ids), "sampling_params": {**sampling_params, "n": n},
                "return_logprob": return_logprob, "rid": rid}
        if return_routed_experts:
            body["return_routed_experts"] = True
        reply = await self._call("POST", "/generate", body=body, timeout_s=timeout_s or self.request_timeout_s)
        if not isinstance(reply, list) or len(reply) != n:
            got = f"a list of {len(reply)}" if isinstance(reply, list) else f"a {type(reply).__name__}"
            raise MalformedReply(self.url, "/generate", "<body>", f"reply is {got}, expected a JSON list of "
                                 f"n={n} objects (asked with sampling_params.n={n})")
        return [parse_generate_reply(r, url=self.url, rid=f"{rid}_{i}", input_len=len(body["input_ids"]),
                                     return_logprob=return_logprob, return_routed_experts=return_routed_experts)
                for i, r in enumerate(reply)]

    async def abort(self, rid: str, *, timeout_s: Optional[float] = None) -> None:
        """Abort one request; its /generate call then answers with finish_reason abort."""
        await self._call("POST", "/abort_request", body={"rid": rid, "abort_all": False},
                         timeout_s=timeout_s or self.control_timeout_s, expect_json=False)

    async def abort_all(self, *, timeout_s: Optional[float] = None) -> None:
        await self._call("POST", "/abort_request", body={"rid": "", "abort_all": True},
                         timeout_s=timeout_s or self.control_timeout_s, expect_json=False)

    async def pause_generation(self, mode: str = "abort", *, timeout_s: Optional[float] = None) -> None:
        """abort: running requests end now with finish abort; retract: they go back to the waiting
        queue (KV freed, recomputed on resume); in_place: they stay, KV kept (flush_cache fails)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {'|'.join(PAUSE_MODES)}, got {mode!r}")
        await self._call("POST", "/pause_generation", body={"mode": mode},
                         timeout_s=timeout_s or self.control_timeout_s)

    async def continue_generation(self, *, timeout_s: Optional[float] = None) -> None:
        await self._call("POST", "/continue_generation", body={},
                         timeout_s=timeout_s or self.control_timeout_s)

    async def release_memory_occupation(self, tags: Optional[Sequence[str]] = None, *,
                                        timeout_s: Optional[float] = None) -> Any:
        """Colocated mode: give the device memory back while the trainer uses it. tags ⊆ weights,
        kv_cache, cuda_graph (none = all); the engine must be idle (pause with mode=abort first).
        Released weights lose their values: resume, then push weights. SGLang needs
        --enable-memory-saver to actually free memory. Returns the reply (SGLang: null)."""
        body = {} if tags is None else {"tags": list(tags)}
        return await self._call("POST", "/release_memory_occupation", body=body,
                                timeout_s=timeout_s or self.control_timeout_s)

    async def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None, *,
                                       timeout_s: Optional[float] = None) -> Any:
        body = {} if tags is None else {"tags": list(tags)}
        return await self._call("POST", "/resume_memory_occupation", body=body,
                                timeout_s=timeout_s or self.control_timeout_s)

    async def flush_cache(self, *, timeout_s: Optional[float] = None) -> None:
        """Drop the prefix cache. SGLang answers 400 while requests run: that is not retried."""
        await self._call_idempotent("POST", "/flush_cache", timeout_s=timeout_s or self.control_timeout_s,
                                    expect_json=False)

    # -- weight updates -----------------------------------------------------------------------
    async def begin_weight_update(self, *, timeout_s: Optional[float] = None) -> bool:
        """Open a weight-update session. False when the server has none (auto mode, 404): the
        session is then only local bookkeeping and updates go straight through."""
        if self._session_state is not None:
            raise RuntimeError(f"{self.url}: a weight-update session is already open")
        if self._server_has_session is not False:
            try:
                self._success("/begin_weight_update", await self._call(
                    "POST", "/begin_weight_update", body={"selector": "all"},
                    timeout_s=timeout_s or self.request_timeout_s))
                self._server_has_session = True
            except EngineHTTPError as e:
                if e.status != 404 or self.weight_update_session_mode != "auto":
                    raise
                self._server_has_session = False
        self._session_state = "server" if self._server_has_session else "local"
        return self._server_has_session

    async def end_weight_update(self, *, timeout_s: Optional[float] = None) -> None:
        """Close the session (also one left open on the server by an earlier, crashed caller)."""
        state, self._session_state = self._session_state, None
        if state != "local" and self._server_has_session is not False:
            self._success("/end_weight_update", await self._call(
                "POST", "/end_weight_update", body={}, timeout_s=timeout_s or self.request_timeout_s))

    @property
    def in_weight_update_session(self) -> bool:
        return self._session_state is not None

    @contextlib.asynccontextmanager
    async def weight_update_session(self) -> AsyncIterator[None]:
        """begin … end around several updates (e.g. all buckets of one sync). End runs on error too,
        without hiding the original error."""
        await self.begin_weight_update()
        try:
            yield
        except BaseException:
            with contextlib.suppress(EngineError):
                await self.end_weight_update()
            raise
        await self.end_weight_update()

    async def _update(self, endpoint: str, body: Dict[str, Any], timeout_s: Optional[float],
                      *, needs_session: bool) -> Dict[str, Any]:
        async def post() -> Dict[str, Any]:
            return self._success(endpoint, await self._call(
                "POST", endpoint, body=body, timeout_s=timeout_s or self.request_timeout_s))

        if not needs_session or self._session_state is not None:
            return await post()
        async with self.weight_update_session():
            return await post()

    async def update_weights_from_tensor(self, serialized_named_tensors: Sequence[Union[str, bytes]], *,
                                         load_format: Optional[str] = None, flush_cache: bool = True,
                                         weight_version: Optional[str] = None,
                                         timeout_s: Optional[float] = None) -> Dict[str, Any]:
        """One entry per engine TP rank: ``MultiprocessingSerializer.serialize(named_tensors,
        output_str=True)`` (base64 of a ForkingPickler dump); bytes are base64-encoded here."""
        payload = [s if isinstance(s, str) else base64.b64encode(s).decode("ascii")
                   for s in serialized_named_tensors]
        body = {"serialized_named_tensors": payload, "load_format": load_format,
                "flush_cache": flush_cache, "weight_version": weight_version}
        return await self._update("/update_weights_from_tensor", body, timeout_s, needs_session=True)

    async def update_weights_from_shared_memory(self, buffer: Dict[str, Any], tensors: Sequence[Dict[str, Any]], *,
                                                timeout_s: Optional[float] = None) -> Dict[str, Any]:
        """The bridge's staged ipc (not an SGLang endpoint: the local engine advertises it as
        ``weight_update_shared_memory`` in /get_server_info); body in engines/shared_weights.py."""
        body = {"buffer": buffer, "tensors": list(tensors), "flush_cache": False, "weight_version": None}
        return await self._update("/update_weights_from_shared_memory", body, timeout_s, needs_session=True)

    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl",
                                        timeout_s: Optional[float] = None) -> Dict[str, Any]:
        """Blocks until every member joined: run it concurrently with the trainer's own join."""
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}
        return await self._update("/init_weights_update_group", body, timeout_s, needs_session=False)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group", *,
                                           timeout_s: Optional[float] = None) -> Dict[str, Any]:
        """Leave and tear down the named weight-update group on the engine."""
        return await self._update("/destroy_weights_update_group", {"group_name": group_name}, timeout_s,
                                  needs_session=False)

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False,
                                    timeout_s: Optional[float] = None) -> Dict[str, Any]:
        """Set the version label the engine reports (meta_info.weight_version) without loading weights."""
        body = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        return await self._update("/update_weight_version", body, timeout_s, needs_session=False)

    async def update_weights_from_distributed(self, *, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]],
                                              group_name: str = "weight_update_group",
                                              flush_cache: bool = True,
                                              weight_version: Optional[str] = None,
                                              load_format: Optional[str] = None,
                                              timeout_s: Optional[float] = None) -> Dict[str, Any]:
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names, dtypes and shapes must have one entry per tensor, got "
                             f"{len(names)}, {len(dtypes)} and {len(shapes)}")
        body = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                "group_name": group_name, "flush_cache": flush_cache, "weight_version": weight_version,
                "load_format": load_format}
        return await self._update("/update_weights_from_distributed", body, timeout_s, needs_session=True)

    async def update_weights_from_disk(self, model_path: str, *, load_format: Optional[str] = None,
                                       weight_version: Optional[str] = None, flush_cache: bool = True,
                                       timeout_s: Optional[float] = None) -> Dict[str, Any]:
        """Reload from a checkpoint directory (no session needed: SGLang wraps it itself)."""
        body = {"model_path": model_path, "load_format": load_format, "weight_version": weight_version,
                "flush_cache": flush_cache}
        return await self._update("/update_weights_from_disk", body, timeout_s, needs_session=False)

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
                                 f"reply is not a JSON object (got {_short(reply)})")
        return reply

    async def server_info(self, *, timeout_s: Optional[float] = None) -> Dict[str, Any]:
        reply = await self._call_idempotent("GET", "/get_server_info", timeout_s=timeout_s or self.control_timeout_s)
        if not isinstance(reply, dict):
            raise MalformedReply(self.url, "/get_server_info", "<body>",
                                 f"reply is not a JSON object (got {_short(reply)})")
        return reply

    async def get_weight_version(self, *, timeout_s: Optional[float] = None) -> str:
        """The engine's current weight version, read from /model_info's weight_version."""
        info = await self.model_info(timeout_s=timeout_s)
        if info.get("weight_version") is None:
            raise MalformedReply(self.url, "/model_info", "weight_version",
                                 "reply lacks weight_version")
        return str(info["weight_version"])

