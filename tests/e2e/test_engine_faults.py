"""Fault test: kill one of two real CPU engine servers (by pid) while requests are in flight through
the proxy. Every request must complete exactly once, on the survivor, with a full answer."""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import pytest

from megatron_flash.rollout.proxy import LLMProxy
from megatron_flash.rollout.sglang_launcher import EngineLauncher


def free_ports(n: int) -> int:
    """A base port with n free consecutive ports above it (checked, then released)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as t:
                try:
                    t.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
        if ok:
            return base
    raise RuntimeError("no free port range")


@pytest.fixture
def two_engines(tiny_models, tmp_path):
    launcher = EngineLauncher(backend="cpu", model_path=tiny_models["llama"], num_engines=2,
                              base_port=free_ports(2), run_dir=str(tmp_path), startup_timeout_s=180)
    with launcher:  # __enter__ starts the servers and waits for /health
        yield launcher


def test_killing_an_engine_loses_and_duplicates_nothing(two_engines) -> None:
    urls, pids = two_engines.urls, two_engines.pids
    num_requests, length = 24, 24

    async def scenario():
        async with LLMProxy.from_urls(urls, max_inflight_per_engine=4, health_check_interval_s=0.5) as proxy:
            params = {"temperature": 1.0, "max_new_tokens": length, "ignore_eos": True}
            tasks = [asyncio.create_task(proxy.generate([5, 6, 7, 8], params, rid=f"req-{i}"))
                     for i in range(num_requests)]
            # Wait until the victim is busy, then kill it mid-generation.
            for _ in range(400):
                if proxy.metrics().as_dict()["proxy/engine0/inflight"] > 0:
                    break
                await asyncio.sleep(0.025)
            os.kill(pids[0], signal.SIGKILL)
            results = await asyncio.gather(*tasks)
            return results, proxy.metrics().as_dict()

    results, metrics = asyncio.run(scenario())
    assert sorted(r.rid for r in results) == sorted(f"req-{i}" for i in range(num_requests))
    assert all(r.finish_reason == "length" and len(r.output_ids) == length for r in results)
    assert all(len(r.output_logprobs) == length for r in results)
    # Requests that were on the killed engine were re-run on the survivor.
    assert metrics["proxy/retried"] >= 1
    assert metrics["proxy/engine0/healthy"] == 0.0
    assert sum(r.engine_url == urls[1] for r in results) >= num_requests - metrics["proxy/engine0/completed"]
