"""An elastic rollout fleet: engines from other allocations join a running run and leave it.

Registration is an HTTP endpoint of trainer rank 0 (engines.join_port; bound to engines.join_host,
`node` = this node's address), authenticated with the run's key (engines.api_key, as a Bearer
token: the same key the engines themselves require). Its URL goes to engines.join_address_file
(default {run_dir}/fleet.json) for workers to find (launch/fleet_worker.py,
launch/slurm/rollout_workers.sbatch):

    POST /fleet/join   {"url": "http://node7:30000", "tp_size": 1, "serves": "<model>"}
         → 202 {"state": "pending"}: it gets the current weights with the next push (a full push; deltas
           after that), the post-sync probe checks it, and then the proxy routes to it. 401 with a
           wrong or missing key (nothing is ever sent to that engine), 400 naming the field that is
           wrong, or when the engine does not answer /get_server_info with the run's key.
    POST /fleet/leave  {"url": ..., "reason": "preempted"} → 200 {"state": "left", "reissued": n}: the
           proxy stops routing to it and re-issues its in-flight requests to other engines before
           the reply, so a worker may stop its engine right after.
    GET  /fleet        → every member and its state.

An engine that joined and then fails engines.attach_probe_failures /health probes in a row is
lost: out of the fleet like one that left (its requests re-issued). Members move
pending → syncing → serving, or to refused (its push or probe failed), left, lost. The run's own
engines (engines.urls, or launched) are in the fleet from the start and may leave too.

Threads: the HTTP server and the health monitor run in threads of their own; the trainer's
weight hand-off takes joins (`take_pending`) and departures (`take_gone`) around each push.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional
from urllib.parse import urlparse

from megatron_flash.trace import TRACER

logger = logging.getLogger(__name__)
GONE = ("left", "lost", "refused")


@dataclass
class Member:
    url: str
    tp_size: int
    serves: str
    state: str
    since: float
    reason: str = ""
    own: bool = False
    """One of the run's own engines (engines.urls or launched), in the fleet from the start."""


class FleetError(ValueError):
    """A registration request that is refused; `status` is its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def node_address() -> str:
    return socket.gethostbyname(socket.getfqdn())


class FleetRegistry:
    """The fleet's members and the registration endpoint; see the module docstring.

    `on_leave(url, why) -> int` takes an engine out of routing and returns how many requests it
    re-issued (the runtime's proxy call); `check_engine(url)` raises unless the engine answers."""

    def __init__(self, *, api_key: str, tp_size: int, own_urls: list[str], host: str = "127.0.0.1", port: int = 0,
                 address_file: str = "", probe_interval_s: float = 2.0, probe_failures: int = 3,
                 on_leave: Optional[Callable[[str, str], int]] = None,
                 check_engine: Optional[Callable[[str], None]] = None) -> None:
        if not api_key:
            raise ValueError("engines.join_port: registration is authenticated with the run's key; set engines.api_key")
        self.api_key, self.tp_size = api_key, tp_size
        self.host = node_address() if host == "node" else host
        self.port, self.address_file = port, address_file
        self.probe_interval_s, self.probe_failures = probe_interval_s, probe_failures
        self.on_leave = on_leave or (lambda url, why: 0)
        self.check_engine = check_engine or self._check_engine
        self._lock = threading.Lock()
        now = time.time()
        self.members: dict[str, Member] = {u.rstrip("/"): Member(u.rstrip("/"), tp_size, "", "serving", now, own=True)
                                           for u in own_urls}
        self._gone: list[str] = []  # left the fleet since the last push: the bridge drops them then
        self._failures: dict[str, int] = {}
        self.counts = {"engines_joined": 0, "engines_left": 0, "requests_reissued": 0, "joins_refused": 0}
        self._server: Optional[ThreadingHTTPServer] = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str:
        """Bind, serve, write the address file; returns the endpoint's URL."""
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:  # requests are logged by the registry itself
                pass

            def do_GET(self) -> None:
                registry._handle(self, "GET")

            def do_POST(self) -> None:
                registry._handle(self, "POST")

        try:
            self._server = ThreadingHTTPServer((self.host, self.port), Handler)
        except OSError as error:
            raise RuntimeError(f"engines.join_port={self.port}: cannot listen on {self.host}:{self.port}: {error}") from None
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://{self.host}:{self.port}"
        for target, name in ((self._server.serve_forever, "fleet-http"), (self._monitor, "fleet-probe")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        if self.address_file:
            os.makedirs(os.path.dirname(os.path.abspath(self.address_file)), exist_ok=True)
            tmp = f"{self.address_file}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump({"url": self.url, "pid": os.getpid(), "host": socket.gethostname(),
                           "tp_size": self.tp_size}, f)
            os.replace(tmp, self.address_file)
        logger.info("fleet registration open at %s (address in %s)", self.url, self.address_file or "-")
        return self.url

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self.address_file and os.path.exists(self.address_file):
            with open(self.address_file) as f:
                ours = f"\"pid\": {os.getpid()}," in f.read()
            if ours:
                os.remove(self.address_file)

    # ------------------------------------------------------------------ HTTP
    def _handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        status, body = 200, {}
        try:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                raise FleetError(401, "unauthorized: the run's key (engines.api_key) is required as a Bearer token")
            path = request.path.rstrip("/")
            if method == "GET" and path == "/fleet":
                body = {"members": self.snapshot()}
            elif method == "POST" and path in ("/fleet/join", "/fleet/leave"):
                length = int(request.headers.get("Content-Length") or 0)
                try:
                    payload = json.loads(request.rfile.read(length) or b"{}")
                except ValueError as error:
                    raise FleetError(400, f"the body is not JSON: {error}") from None
                if not isinstance(payload, dict):
                    raise FleetError(400, "the body must be a JSON object")
                if path == "/fleet/join":
                    status, body = 202, self.join(payload)
                else:
                    body = self.leave(payload)
            else:
                raise FleetError(404, f"no route {method} {request.path}")
        except FleetError as error:
            status, body = error.status, {"error": str(error)}
        except Exception as error:  # noqa: BLE001 - a registration never takes the trainer down
            logger.exception("fleet endpoint: %s %s failed", method, request.path)
            status, body = 500, {"error": f"{type(error).__name__}: {error}"}
        data = json.dumps(body).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    # ------------------------------------------------------------------ join / leave
    def join(self, payload: dict) -> dict:
        url = payload.get("url")
        parsed = urlparse(url) if isinstance(url, str) else None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname or not parsed.port:
            raise FleetError(400, f"url: expected http://host:port of the engine, got {url!r}")
        url = url.rstrip("/")
        tp = payload.get("tp_size", 1)
        if not isinstance(tp, int) or isinstance(tp, bool) or tp != self.tp_size:
            raise FleetError(400, f"tp_size: this run's engines have engines.tp_size={self.tp_size} (its weight "
                                  f"pushes are laid out for it), {url} registered {tp!r}")
        serves = payload.get("serves", "")
        if not isinstance(serves, str):
            raise FleetError(400, f"serves: expected a string (the model the engine serves), got {serves!r}")
        with self._lock:
            known = self.members.get(url)
            if known is not None and known.state not in GONE:
                return {"state": known.state, "url": url}
        try:
            self.check_engine(url)
        except Exception as error:  # noqa: BLE001 - any failure refuses the join, by name
            self.counts["joins_refused"] += 1
            raise FleetError(400, f"url: {url} does not answer /get_server_info with the run's key: {error}") from None
        with self._lock:
            self.members[url] = Member(url, tp, serves, "pending", time.time())
            self._failures.pop(url, None)
        logger.info("engine %s registered (serves %s): it gets the weights with the next push", url, serves or "?")
        TRACER.instant("engine registered", "fleet", "fleet", url=url)
        return {"state": "pending", "url": url}

    def leave(self, payload: dict) -> dict:
        url = str(payload.get("url") or "").rstrip("/")
        reason = str(payload.get("reason") or "deregistered")
        with self._lock:
            member = self.members.get(url)
            if member is None:
                raise FleetError(404, f"url: {url!r} is not in this run's fleet")
            if member.state in GONE:
                return {"state": member.state, "url": url, "reissued": 0}
            was_serving = member.state in ("serving", "syncing")
            self._mark(member, "left", reason)
        reissued = self._remove(url, f"left: {reason}") if was_serving else 0
        return {"state": "left", "url": url, "reissued": reissued}

    def _mark(self, member: Member, state: str, reason: str) -> None:
        """Under the lock."""
        member.state, member.reason, member.since = state, reason, time.time()
        if state in ("left", "lost"):
            self.counts["engines_left"] += 1
            self._gone.append(member.url)
        TRACER.instant(f"engine {state}", "fleet", "fleet", url=member.url, reason=reason)

    def _remove(self, url: str, why: str) -> int:
        reissued = int(self.on_leave(url, why) or 0)
        with self._lock:
            self.counts["requests_reissued"] += reissued
        logger.warning("engine %s out of the fleet (%s); %d request(s) re-issued", url, why, reissued)
        return reissued

    # ------------------------------------------------------------------ the weight hand-off's side
    def take_pending(self) -> list[str]:
        """Engines registered since the last push: they get it (whole), then the probe."""
        with self._lock:
            pending = [m for m in self.members.values() if m.state == "pending"]
            for m in pending:
                m.state = "syncing"
            return [m.url for m in pending]

    def take_gone(self) -> list[str]:
        """Engines that left or were lost since the last call: the weight bridge forgets them."""
        with self._lock:
            gone, self._gone = self._gone, []
            return gone

    def settle(self, synced: list[str], failed: dict[str, str]) -> list[str]:
        """After the push that carried `take_pending`'s engines: which of them serve now (they were
        pushed and passed the probe) — the caller routes to these; the others are refused."""
        admitted = []
        with self._lock:
            for url, why in failed.items():
                member = self.members.get(url)
                if member is not None and member.state == "syncing":
                    self._mark(member, "refused", why)
                    self._gone.append(url)  # the bridge forgets it at the next push
                    self.counts["joins_refused"] += 1
                    logger.warning("engine %s refused: %s", url, why)
            for url in synced:
                member = self.members.get(url)
                if member is not None and member.state == "syncing":
                    self._mark(member, "serving", "")
                    self.counts["engines_joined"] += 1
                    admitted.append(url)
        return admitted

    def take_counts(self) -> dict[str, float]:
        """Cumulative counters, and the engines registered and not yet serving (metrics)."""
        with self._lock:
            out = {k: float(v) for k, v in self.counts.items()}
            out["engines_pending"] = float(sum(m.state in ("pending", "syncing") for m in self.members.values()))
        return out

    def snapshot(self) -> list[dict]:
        with self._lock:
            return [asdict(m) for m in self.members.values()]

    # ------------------------------------------------------------------ health of joined engines
    def _monitor(self) -> None:
        while not self._stop.wait(self.probe_interval_s):
            with self._lock:
                watched = [m.url for m in self.members.values() if m.state == "serving" and not m.own]
            for url in watched:
                ok = self._healthy(url)
                with self._lock:
                    member = self.members.get(url)
                    if member is None or member.state != "serving":
                        continue
                    self._failures[url] = 0 if ok else self._failures.get(url, 0) + 1
                    lost = self._failures[url] >= self.probe_failures
                    if lost:
                        self._mark(member, "lost", f"{self.probe_failures} failed /health probes in a row")
                if lost:
                    self._remove(url, f"lost: {self.probe_failures} failed /health probes in a row")

    def _healthy(self, url: str) -> bool:
        try:
            self._get(url, "/health", timeout_s=5.0)
            return True
        except Exception:  # noqa: BLE001 - any failure is a failed probe
            return False

    def _check_engine(self, url: str) -> None:
        info = self._get(url, "/get_server_info", timeout_s=10.0)
        if not isinstance(info, dict):
            raise ValueError(f"/get_server_info answered {type(info).__name__}, not an object")

    def _get(self, url: str, path: str, *, timeout_s: float) -> Any:
        req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {self.api_key}"})
        with urllib.request.urlopen(req, timeout=timeout_s) as reply:
            data = reply.read()
        try:
            return json.loads(data or b"null")
        except ValueError:
            return None
