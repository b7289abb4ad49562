"""Continuous batching vs static batches on the local engine server, long-tail response lengths.

    python benchmarks/continuous_batching.py [--requests 384] [--max-len 128] [--batch 16] [--seed 0]

One local engine server (tiny model, 1 thread) serves the same requests twice:
  static      requests go in batches of --batch; the next batch starts only when the slowest request
              of the current one has finished (what a step-synchronous rollout does);
  continuous  all requests are submitted with at most --batch in flight at once: a new request
              enters the moment any finishes (queue scheduling through the proxy).
Response lengths are drawn from a long-tail distribution (P(len = k) ∝ 1/k, 1 ≤ k ≤ --max-len),
forced with ignore_eos + max_new_tokens, so both modes generate exactly the same tokens.
The last line is a JSON object with both tokens/s and `ratio` = continuous / static.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_flash.ports import free_ports  # noqa: E402



def lengths(n: int, max_len: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    ks = list(range(1, max_len + 1))
    return rng.choices(ks, weights=[1.0 / k for k in ks], k=n)


async def run_mode(url: str, mode: str, prompts: list[list[int]], lens: list[int], batch: int) -> dict:
    from megatron_flash.rollout.proxy import LLMProxy

    async with LLMProxy.from_urls([url], max_inflight_per_engine=batch) as proxy:
        def params(k: int) -> dict:
            return {"temperature": 1.0, "max_new_tokens": k, "ignore_eos": True}

        t0 = time.perf_counter()
        if mode == "continuous":
            results = await asyncio.gather(*[proxy.generate(p, params(k)) for p, k in zip(prompts, lens)])
        else:
            results = []
            for i in range(0, len(prompts), batch):
                results += await asyncio.gather(*[proxy.generate(p, params(k))
                                                  for p, k in zip(prompts[i:i + batch], lens[i:i + batch])])
        seconds = time.perf_counter() - t0
        m = proxy.metrics().as_dict()
    tokens = sum(len(r.output_ids) for r in results)
    assert tokens == sum(lens), (tokens, sum(lens))
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "proxy": m}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=384)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-path", default="")
    args = p.parse_args()
    from megatron_flash.engines.launcher import EngineLauncher

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model_path or os.path.join(tmp, "model")
        if not args.model_path:
            subprocess.run([sys.executable, os.path.join(REPO, "tools/make_tiny_model.py"), "--out", model],
                           check=True, capture_output=True)
        lens = lengths(args.requests, args.max_len, args.seed)
        rng = random.Random(args.seed + 1)
        prompts = [[rng.randrange(4, 40) for _ in range(5)] for _ in range(args.requests)]
        launcher = EngineLauncher(backend="local", model_path=model, num_engines=1, base_port=free_ports(1),
                                  run_dir=os.path.join(tmp, "run"), startup_timeout_s=180,
                                  server_args={"max-running-requests": args.batch,
                                               "context-length": 5 + args.max_len + 3})
        with launcher:
            url = launcher.urls[0]
            asyncio.run(run_mode(url, "continuous", prompts[:8], lens[:8], args.batch))  # warm-up
            static = asyncio.run(run_mode(url, "static", prompts, lens, args.batch))
            continuous = asyncio.run(run_mode(url, "continuous", prompts, lens, args.batch))
    result = {
        "requests": args.requests, "batch": args.batch, "max_len": args.max_len,
        "mean_len": sum(lens) / len(lens), "longest": max(lens),
        "static_tokens_per_s": round(static["tokens_per_s"], 1),
        "continuous_tokens_per_s": round(continuous["tokens_per_s"], 1),
        "static_seconds": round(static["seconds"], 2), "continuous_seconds": round(continuous["seconds"], 2),
        "ratio": round(continuous["tokens_per_s"] / static["tokens_per_s"], 3),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
