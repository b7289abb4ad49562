"""What every call of `EngineClient` stands on: the typed errors, the one HTTP exchange (and its
retries for idempotent calls), the ``{"success": bool}`` check of control replies, and the small value
checks that name a malformed field.

`EngineTransport` holds the HTTP session; `EngineClient.__init__` (client.py) sets the URL, timeouts and
retry settings it reads. The call families built on it are `client_generation.py` (generation, scoring,
abort, pause) and `client_weights.py` (weight updates, engine memory); `client.py` joins them and adds
the probes. Nothing here knows an endpoint's body.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any, Dict, Mapping, Optional

import aiohttp


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


def deterministic_refusal(error: Optional[BaseException]) -> Optional[BaseException]:
    """The engine's HTTP 4xx refusal behind `error` (prompt too long, bad sampling parameters, an
    unknown field): the same request is refused again anywhere. 408 and 429 are transient."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if (isinstance(error, EngineHTTPError) and 400 <= error.status < 500 and error.status not in (408, 429)
                and "duplicate request id" not in error.body.lower()):  # a timed-out copy still there: transient
            return error
        error = error.__cause__ or error.__context__
    return None


class MalformedReply(EngineError):
    """The reply does not follow SGLang's JSON contract; ``field`` names the offending field."""

    def __init__(self, url: str, endpoint: str, field: str, detail: str) -> None:
        self.field = field
        super().__init__(url, endpoint, detail)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and not math.isnan(x)


def describe_len(x: Any) -> str:
    return str(len(x)) if isinstance(x, list) else f"no list ({type(x).__name__})"


def short_repr(x: Any, limit: int = 120) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[:limit] + "…"


KEEPALIVE_S = 3.0  # below uvicorn's timeout_keep_alive (5 s): see EngineTransport._session


class EngineTransport:
    """The HTTP side of one engine client: one aiohttp session, opened on first use, closed by `close()`."""

    url: str
    api_key: Optional[str]
    request_timeout_s: float
    control_timeout_s: float
    max_retries: int
    retry_backoff_s: float
    retry_backoff_max_s: float
    _http: Optional[aiohttp.ClientSession]

    async def close(self) -> None:
        if self._http is not None and not self._http.closed:
            await self._http.close()
        self._http = None

    # -- transport --------------------------------------------------------------------------
    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            # The proxy bounds concurrency per engine; the connector must not add a second limit. Pooled
            # connections idle for KEEPALIVE_S are not reused: uvicorn (SGLang's server and ours) closes
            # them at 5 s idle, and aiohttp's 15 s default reused some just as they closed, so a
            # /generate sent then failed with ServerDisconnected / connection reset.
            self._http = aiohttp.ClientSession(headers=headers,
                                               connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S))
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
                                 f"reply is not JSON ({e}): {short_repr(text)}") from e

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
                                 f"reply lacks a boolean success field (got {short_repr(reply)})")
        if not reply["success"]:
            raise EngineHTTPError(self.url, endpoint, 200, json.dumps(reply))
        return reply
