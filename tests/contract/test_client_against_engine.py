"""Our EngineClient (what the rollout side uses) against real engines, one backend per BACKENDS entry.

The raw-HTTP modules pin the server side of the contract; this one pins the client side: the same
calls, through `megatron_flash.engines.client`, parse and behave as documented on every
backend. Shares the session's server: the weight swap below puts the checkpoint back.
"""

from __future__ import annotations

import asyncio
import base64
import io

import pytest

from megatron_flash.engines.client import EngineClient
from tests.contract.helpers import StreamingGenerate, assert_logprobs_match, generate, teacher_logprobs

PROMPT = [1, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def server(engine):
    """The session's engine (a real SGLang start costs ~40 s): the one test here that changes its
    weights restores them, label "default" included, and checks that it did."""
    return engine


def run(coro):
    return asyncio.run(coro)


def test_generate_parses_logprobs_and_finish(server) -> None:
    async def go():
        async with EngineClient(server.url) as c:
            return await c.generate(PROMPT, {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True}, rid="c-1")

    res = run(go())
    assert res.rid == "c-1" and res.finish_reason == "length" and len(res.output_ids) == 12
    ref = teacher_logprobs(server.model_dir, PROMPT, res.output_ids, temperature=1.0)
    diff = max(abs(a - b) for a, b in zip(res.output_logprobs, ref))
    print(f"[{server.backend}] client-parsed behavior logprobs vs teacher-forced: {diff:.3g}")
    assert diff <= 1e-4


def test_abort_by_rid_and_abort_all_return_partial_outputs(server) -> None:
    """A streamed probe request starts first; 64 long requests follow and need ~16x the local engine's
    KV, so they queue (FIFO) behind the first wave. Progress is read from the probe, not from a clock:
    at 30 streamed chunks every request has reached the server and the last one is still waiting when
    it is aborted by rid; at 60 (of 240) the first wave, probe included, is mid-generation when
    abort_all lands — on the local engine server (waves) and on SGLang (all at once) alike. Fixed sleeps raced
    both ways (a wave finished before the abort on a fast machine, nothing started on a loaded one)."""
    params = {"temperature": 1.0, "max_new_tokens": 240, "ignore_eos": True}
    n = 64

    async def until(probe: StreamingGenerate, chunks: int) -> None:
        deadline = asyncio.get_running_loop().time() + 120
        while probe.num_chunks() < chunks and not probe.done():
            assert asyncio.get_running_loop().time() < deadline, f"probe stuck at {probe.num_chunks()} chunks"
            await asyncio.sleep(0.002)

    async def go():
        async with EngineClient(server.url) as c:
            # the server is shared: requests an earlier test left running would hold the KV of the
            # first wave, and every request here would then be aborted while still queued
            await c.abort_all()
            await asyncio.sleep(0.5)
            probe = StreamingGenerate(server.url, PROMPT, rid="c-probe", sampling_params=params)
            await asyncio.to_thread(probe.wait_started)
            tasks = [asyncio.create_task(c.generate(PROMPT, params, rid=f"c-long-{i}")) for i in range(n)]
            await until(probe, 30)
            await c.abort(f"c-long-{n - 1}")
            await until(probe, 60)
            await c.abort_all()
            results = await asyncio.gather(*tasks)
            await asyncio.to_thread(probe.result)
            return results

    results = run(go())
    victim = results[-1]
    assert victim.rid == f"c-long-{n - 1}" and victim.aborted and len(victim.output_ids) < 240
    assert len(victim.output_logprobs) == len(victim.output_ids)
    aborted = [r for r in results if r.aborted]
    assert len(aborted) >= n // 2  # abort_all caught every request still queued or running
    partial = [r for r in aborted if 0 < len(r.output_ids) < 240]
    assert partial, "abort_all returned no partial output from a running request"
    for r in results:
        assert r.finish_reason in ("abort", "length")
        assert len(r.output_logprobs) == len(r.output_ids)


def test_pause_continue_and_weight_update_through_the_client(server, seed1_model) -> None:
    import torch.multiprocessing as mp
    from multiprocessing.reduction import ForkingPickler
    from safetensors.torch import load_file

    mp.set_sharing_strategy("file_system")
    named = sorted(load_file(f"{seed1_model}/model.safetensors").items())
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    payload = [base64.b64encode(buf.getvalue()).decode()]

    async def go():
        async with EngineClient(server.url) as c:
            await c.pause_generation("retract")
            async with c.weight_update_session():
                await c.update_weights_from_tensor(payload, load_format=None, flush_cache=True, weight_version="7")
            await c.continue_generation()
            version = await c.get_weight_version()
            res = await c.generate(PROMPT, {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True})
            await c.update_weights_from_disk(server.model_dir, weight_version="default")  # restore seed 0
            return version, res, await c.get_weight_version()

    version, res, restored = run(go())
    assert version == "7" and res.weight_version == "7"
    assert restored == "default"
    out = generate(server.url, PROMPT, return_logprob=True,  # the checkpoint's weights again
                   sampling_params={"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True})
    assert_logprobs_match(server.model_dir, PROMPT, out, temperature=1.0)
    ref = teacher_logprobs(seed1_model, PROMPT, res.output_ids, temperature=1.0)
    assert max(abs(a - b) for a, b in zip(res.output_logprobs, ref)) <= 1e-4
    del named


def test_more_kv_demand_than_the_cache_queues_instead_of_failing(server) -> None:
    """16 × (5 + 240) tokens need ~4× the local engine server's KV (64 blocks × 16): requests must wait for KV,
    all finish with their full length, and the engine keeps serving afterwards."""
    params = {"temperature": 1.0, "max_new_tokens": 240, "ignore_eos": True}

    async def go():
        async with EngineClient(server.url) as c:
            results = await asyncio.gather(*[c.generate(PROMPT, params, rid=f"kv-{i}") for i in range(16)])
            after = await c.generate(PROMPT, {"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True})
            return results, after

    results, after = run(go())
    assert [r.finish_reason for r in results] == ["length"] * 16
    assert all(len(r.output_ids) == 240 for r in results)
    assert after.finish_reason == "length" and len(after.output_ids) == 4
