#!/usr/bin/env python
"""Join engines to a running megatron-flash run, keep them in its fleet, and take them out on a signal.

    python launch/fleet_worker.py --address-file logs/slurm/1234/fleet.json \\
        --engine http://node7:30000 --engine http://node7:30001 [--tp-size 1] [--serves MODEL]

The run's key comes from $SGLANG_API_KEY or --key-file (the same key the engines were started with).
The worker waits until each engine answers /health, registers it (POST /fleet/join on the endpoint
named in the address file, which trainer rank 0 writes: engines.join_port), then watches: an engine
that the run lost (failed probes, a link cut) or refused is registered again once it answers; a run
that is not up yet (no address file) is waited for. On SIGTERM, SIGINT or SIGUSR1 (a preemption, a
requeue, scancel) it deregisters every engine (POST /fleet/leave: the run re-issues their in-flight
requests before it answers) and exits 0, before the engines are stopped — so no request is lost and
none is trained twice. `--leave` deregisters and exits at once (an operator taking engines back).

Exit codes: 0 done; 2 bad arguments; 3 the run refused the key (401: wrong key, never retried).
Run by launch/slurm/rollout_workers.sbatch; docs/cluster.md "An elastic rollout fleet".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Optional


def log(message: str) -> None:
    print(f"[fleet_worker {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Refused(RuntimeError):
    pass


class Worker:
    def __init__(self, args: argparse.Namespace, key: str) -> None:
        self.args, self.key = args, key
        self.engines = [u.rstrip("/") for u in args.engine]
        self.registered: set[str] = set()
        self.stopping = False
        self.ended = False
        self.answering = True

    def registry(self) -> Optional[str]:
        try:
            with open(self.args.address_file) as f:
                return json.load(f)["url"]
        except (OSError, ValueError, KeyError):
            return None

    def call(self, base: str, method: str, path: str, body: Optional[dict] = None, timeout_s: float = 30.0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(base + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as reply:
                return json.loads(reply.read() or b"null")
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")
            if error.code == 401:
                raise Refused(f"{base}{path}: 401 {detail}") from None
            raise RuntimeError(f"{base}{path}: HTTP {error.code} {detail}") from None

    def healthy(self, url: str) -> bool:
        try:
            self.call(url, "GET", "/health", timeout_s=5.0)
            return True
        except Refused:
            return True  # answers, but /health wants a key it was not given: the join's own check decides
        except Exception:  # noqa: BLE001 - not up (yet)
            return False

    def states(self, base: str) -> dict[str, str]:
        return {m["url"]: m["state"] for m in self.call(base, "GET", "/fleet", timeout_s=10.0)["members"]}

    def tick(self) -> None:
        """Register every engine that is up and not in the fleet (first time, or lost/refused since)."""
        base = self.registry()
        if base is None:
            if self.registered:  # the run removed its address file: it ended
                log("the run's address file is gone: the run ended")
                self.stopping = self.ended = True
            return
        try:
            states = self.states(base)
        except Refused:
            raise
        except Exception as error:  # noqa: BLE001 - the run may be between steps or gone: retry
            if self.answering:  # once per outage, not every poll
                log(f"the run at {base} does not answer: {error}; trying again every {self.args.poll_s:g} s")
            self.answering = False
            return
        if not self.answering:
            log(f"the run at {base} answers again")
        self.answering = True
        for url in self.engines:
            state = states.get(url)
            if state in ("pending", "syncing", "serving"):
                self.registered.add(url)
                continue
            if state is not None and url in self.registered:
                log(f"{url} is {state} in the run's fleet: registering it again when it answers")
                self.registered.discard(url)
            if not self.healthy(url):
                continue
            try:
                reply = self.call(base, "POST", "/fleet/join", {"url": url, "tp_size": self.args.tp_size,
                                                                "serves": self.args.serves}, timeout_s=60.0)
                log(f"registered {url} with {base}: {reply.get('state')}")
                self.registered.add(url)
            except Refused:
                raise
            except Exception as error:  # noqa: BLE001 - refused this time (e.g. not ready): try again
                log(f"registering {url} failed: {error}")

    def leave(self, reason: str) -> None:
        base = self.registry()
        if base is None:
            log("no address file: nothing to deregister")
            return
        for url in self.engines:
            try:
                reply = self.call(base, "POST", "/fleet/leave", {"url": url, "reason": reason}, timeout_s=30.0)
                log(f"deregistered {url} ({reason}): {reply.get('state')}, {reply.get('reissued', 0)} request(s) re-issued")
            except Exception as error:  # noqa: BLE001 - the run may be gone: nothing left to tell it
                log(f"deregistering {url}: {error}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address-file", required=True, help="the run's engines.join_address_file")
    parser.add_argument("--engine", action="append", required=True, help="an engine's base URL (repeatable)")
    parser.add_argument("--tp-size", type=int, default=1, help="GPUs per engine (must be the run's engines.tp_size)")
    parser.add_argument("--serves", default="", help="what the engines serve (the model path), for the fleet's records")
    parser.add_argument("--key-file", default="", help="a file holding the run's key (else $SGLANG_API_KEY)")
    parser.add_argument("--poll-s", type=float, default=2.0, help="seconds between checks of the fleet")
    parser.add_argument("--leave", action="store_true", help="deregister the engines and exit")
    parser.add_argument("--reason", default="preempted", help="why the engines leave (recorded by the run)")
    args = parser.parse_args(argv)
    key = os.environ.get("SGLANG_API_KEY", "")
    if args.key_file:
        try:
            key = open(args.key_file).read().strip()
        except OSError as error:
            parser.error(f"--key-file {args.key_file}: {error}")
    if not key:
        parser.error("the run's key is needed: set SGLANG_API_KEY or pass --key-file")
    worker = Worker(args, key)
    if args.leave:
        worker.leave(args.reason)
        return 0

    def on_signal(signum: int, frame: Any) -> None:
        worker.stopping = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, on_signal)
    log(f"watching {args.address_file} for {len(worker.engines)} engine(s)")
    try:
        while not worker.stopping:
            worker.tick()
            deadline = time.monotonic() + args.poll_s
            while not worker.stopping and time.monotonic() < deadline:
                time.sleep(0.1)
    except Refused as error:
        log(f"the run refused this worker's key: {error}")
        return 3
    if not worker.ended:
        worker.leave(args.reason)
    return 0


if __name__ == "__main__":
    sys.exit(main())
