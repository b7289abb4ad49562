"""Load: N concurrent requests through the proxy against local engine servers.

    python benchmarks/proxy_load.py [--requests 1000] [--engines 2] [--max-new-tokens 8] [--inflight 64]

All requests are submitted at once (N coroutines, one HTTP request each when its slot frees); the
proxy keeps at most --inflight per engine. Checked: every request completes exactly once with its
full length (no deadlock, no loss). Reported: wall seconds, requests/s, peak RSS of this client
process (ru_maxrss) and of each engine server (VmHWM), and the client's RSS growth per 1,000 queued
requests (bounded memory). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def rss_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


async def load(urls: list[str], *, requests: int, max_new_tokens: int, inflight: int, seed: int) -> dict:
    from megatron_flash.rollout.proxy import LLMProxy

    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(4, 40) for _ in range(6)] for _ in range(requests)]
    params = {"temperature": 1.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    async with LLMProxy.from_urls(urls, max_inflight_per_engine=inflight) as proxy:
        rss_before = rss_kb(os.getpid(), "VmRSS")
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(proxy.generate(p, params, rid=f"load-{i}")) for i, p in enumerate(prompts)]
        await asyncio.sleep(0.5)
        rss_queued = rss_kb(os.getpid(), "VmRSS")
        results = await asyncio.gather(*tasks)
        seconds = time.perf_counter() - t0
        m = proxy.metrics()
    rids = [r.rid for r in results]
    assert len(set(rids)) == requests, "a request was answered twice or not at all"
    assert all(len(r.output_ids) == max_new_tokens and r.finish_reason == "length" for r in results)
    return {"seconds": seconds, "rss_before_kb": rss_before, "rss_queued_kb": rss_queued,
            "max_inflight_seen": [e.max_inflight for e in m.engines], "completed": m.completed}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--inflight", type=int, default=64, help="proxy slots per engine")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from megatron_flash.engines.launcher import EngineLauncher
    from megatron_flash.ports import free_ports

    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "model")
        subprocess.run([sys.executable, os.path.join(REPO, "tools/make_tiny_model.py"), "--out", model],
                       check=True, capture_output=True)
        base = free_ports(args.engines)
        launcher = EngineLauncher(backend="local", model_path=model, num_engines=args.engines, base_port=base,
                                  run_dir=os.path.join(tmp, "run"), startup_timeout_s=180,
                                  server_args={"max-running-requests": 64})
        with launcher:
            out = asyncio.run(load(launcher.urls, requests=args.requests, max_new_tokens=args.max_new_tokens,
                                   inflight=args.inflight, seed=args.seed))
            engine_peak_mb = [round(rss_kb(pid, "VmHWM") / 1024, 1) for pid in launcher.pids]
    client_peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {
        "requests": args.requests, "engines": args.engines, "inflight_per_engine": args.inflight,
        "max_new_tokens": args.max_new_tokens, "seconds": round(out["seconds"], 2),
        "requests_per_s": round(args.requests / out["seconds"], 1), "completed": out["completed"],
        "max_inflight_seen": out["max_inflight_seen"], "client_peak_rss_mb": round(client_peak_mb, 1),
        "client_rss_growth_mb_while_queued": round((out["rss_queued_kb"] - out["rss_before_kb"]) / 1024, 1),
        "engine_peak_rss_mb": engine_peak_mb,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
