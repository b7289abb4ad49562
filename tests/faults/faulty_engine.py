"""A real HTTP server in front of a real engine server that injects the faults a long run meets.

Every request is forwarded to the engine unchanged (weight updates, health, aborts, ...), except the
`/generate` requests a rule picks, which get instead:

    refuse   HTTP 400 with SGLang's error shape ("longer than the model's context length"), for a prompt
    error    HTTP 500, every time, for a prompt (an input that crashes the server)
    burst    HTTP 503, once each, for the next `burst` requests not faulted before
    stall    no reply at all (the connection stays open), once, for the next fresh request
    garbage  HTTP 200 with a body that is not JSON, once, for the next fresh request

Bursts, the stall and the garbage start after `start_after` requests were forwarded, and each hits
a request (rid) that no fault hit before and whose prompt is not `spare`, so every one of them
must be recovered by exactly one retry. `on_weight_update` (optional) is called when a weight-update call arrives, before it is
forwarded. The log (`events`) lists (rid, prompt, action) for every `/generate`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from typing import Callable, Optional, Sequence

import aiohttp
from aiohttp import web

from megatron_flash.ports import free_ports

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


class FaultyEngine:
    def __init__(self, upstream: str, prompts: Sequence[Sequence[int]], *, refuse: Sequence[int] = (),
                 error: Sequence[int] = (), start_after: int = 0, burst: int = 0, stall: bool = False,
                 garbage: bool = False, stall_s: float = 600.0, spare: Sequence[int] = ()) -> None:
        self.upstream = upstream.rstrip("/")
        self.prompts = [list(p) for p in prompts]  # index → token ids, to tell which prompt a request is
        self.refuse, self.error, self.spare = set(refuse), set(error), set(spare)
        self.start_after, self.stall_s = start_after, stall_s
        self.pending = ["burst"] * burst + (["stall"] if stall else []) + (["garbage"] if garbage else [])
        self.events: list[tuple[str, Optional[int], str]] = []
        self.faulted: set[str] = set()
        self.forwarded = 0
        self.on_weight_update: Optional[Callable[[str], None]] = None
        self.port = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._runner: Optional[web.AppRunner] = None
        self._session: Optional[aiohttp.ClientSession] = None
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._closing: Optional[asyncio.Event] = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "FaultyEngine":
        ready = threading.Event()

        def main() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self._start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=main, daemon=True, name="faulty-engine")
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the faulty engine did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._thread is not None
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    async def _start(self) -> None:
        self._closing = asyncio.Event()
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _stop(self) -> None:
        assert self._runner is not None and self._session is not None and self._closing is not None
        self._closing.set()  # ends a stalled request
        await self._runner.cleanup()
        await self._session.close()

    # ------------------------------------------------------------------ the faults
    def prompt_of(self, input_ids: Sequence[int]) -> Optional[int]:
        """The dataset prompt a request continues (a resumed request carries its output too)."""
        for index, ids in enumerate(self.prompts):
            if list(input_ids[:len(ids)]) == ids:
                return index
        return None

    def count(self, action: str) -> int:
        with self._lock:
            return sum(a == action for _, _, a in self.events)

    def _choose(self, rid: str, prompt: Optional[int]) -> str:
        with self._lock:
            if prompt in self.refuse:
                action = "refuse"
            elif prompt in self.error:
                action = "error"
            elif (self.pending and self.forwarded >= self.start_after and rid not in self.faulted
                  and prompt not in self.spare):
                action = self.pending.pop(0)
                self.faulted.add(rid)
            else:
                action = "forward"
                self.forwarded += 1
            self.events.append((rid, prompt, action))
            return action

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.path == "/generate":
            payload = json.loads(body)
            action = self._choose(str(payload.get("rid")), self.prompt_of(payload.get("input_ids") or []))
            if action == "refuse":
                n = len(payload["input_ids"])
                return web.json_response({"error": {"message": f"The input ({n} tokens) is longer than the "
                                                               "model's context length (8 tokens)."}}, status=400)
            if action == "error":
                return web.json_response({"error": {"message": "internal server error"}}, status=500)
            if action == "burst":
                return web.json_response({"error": {"message": "server overloaded"}}, status=503)
            if action == "stall":
                assert self._closing is not None
                with contextlib.suppress(asyncio.TimeoutError):  # holds the connection; the client must give up
                    await asyncio.wait_for(self._closing.wait(), self.stall_s)
                return web.Response(status=500)
            if action == "garbage":
                return web.Response(status=200, body=b'{"text": "cut off mid-reply', content_type="application/json")
        elif request.path.startswith("/update_weights") and self.on_weight_update is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.on_weight_update, request.path)
        return await self._forward(request, body)

    async def _forward(self, request: web.Request, body: bytes) -> web.Response:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        async with self._session.request(request.method, self.upstream + request.path_qs, data=body,
                                         headers=headers) as resp:
            data = await resp.read()
            return web.Response(status=resp.status, body=data, content_type=resp.content_type)
