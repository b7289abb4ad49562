"""--decode-step-ms T of the local engine (latency injection for benchmarks and cluster tests): with both
decoders every decode step delivers its tokens at least T after it began, for 1 and for 8 running
sequences; the decoder thread holds no lock of the engine or of admission while it waits out the floor;
/get_server_info reports T, and a negative T is refused (argparse, and the engine itself).

Only lower bounds on time are asserted: a floor is a lower bound by definition, and no upper bound is
a correctness property of it."""

from __future__ import annotations

import asyncio
import time

import pytest
from starlette.testclient import TestClient

from megatron_flash.engines.local_engine import LocalEngine
from megatron_flash.engines.local_server import build_app, main
from megatron_flash.engines.sampling import SamplingSpec

FLOOR_MS = 50.0
NEW_TOKENS = 6  # static: the first token comes from the prefill pass, which decodes too → ≥ 5 passes


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama, made in this process (torch is imported already; a subprocess costs ~5 s)."""
    import torch

    from tools.make_tiny_model import main as make_tiny_model

    path = str(tmp_path_factory.mktemp("floor") / "llama")
    with torch.random.fork_rng():  # the tool seeds torch's global generator: leave the test process's alone
        make_tiny_model(["--out", path, "--arch", "llama", "--seed", "0"])
    return path


def engine_of(model: str, decoder: str, ms: float) -> LocalEngine:
    kw = {"max_running_requests": 8, "context_length": 64} if decoder == "static" else {"num_blocks": 64}
    return LocalEngine(model_path=model, decoder=decoder, seed=0, decode_step_ms=ms, **kw)


def generate(engine: LocalEngine, num: int, probe=None, tokens: int = NEW_TOKENS) -> tuple[float, list]:
    """`num` requests of `tokens` each, admitted together; wall seconds until all are done. `probe`,
    if given, runs on the event loop while they decode."""
    params = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}

    async def go() -> tuple[float, list]:
        spec = SamplingSpec.from_json(params, vocab_size=engine.vocab_size)
        t0 = time.perf_counter()
        reqs = await asyncio.gather(*(engine.admit(rid=f"q{i}", prompt_ids=[3 + i, 5, 7], spec=spec)
                                      for i in range(num)))
        if probe is not None:
            await probe()
        for req in reqs:
            await asyncio.wait_for(req.done.wait(), 60)
        elapsed = time.perf_counter() - t0
        for req in reqs:
            engine.release(req)
        return elapsed, reqs

    return asyncio.run(go())


@pytest.mark.parametrize("decoder", ["static", "cb"])
def test_every_step_lasts_at_least_the_floor_for_1_and_8_sequences(llama: str, decoder: str) -> None:
    engine = engine_of(llama, decoder, FLOOR_MS)
    try:
        for num in (1, 8):
            before = engine.step_profile.snapshot()
            elapsed, reqs = generate(engine, num)
            after = engine.step_profile.snapshot()
            assert all(len(r.output_ids) == NEW_TOKENS and r.finish["type"] == "length" for r in reqs)
            # NEW_TOKENS tokens need at least NEW_TOKENS - 1 passes (a prefill pass may give two), each ≥ T
            assert elapsed >= (NEW_TOKENS - 1) * FLOOR_MS / 1e3, (decoder, num, elapsed)
            # the floor padded the steps (the tiny model's own step for one sequence takes ~1 ms); how much
            # depends on the box's load (a loaded 2-core box stretches the steps' own work), so only that it did
            if num == 1:
                assert after["floor_s"] - before["floor_s"] > 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("decoder", ["static", "cb"])
def test_the_floor_holds_no_lock_of_admission_or_requests(llama: str, decoder: str) -> None:
    """While the decoder thread waits out a long floor, the locks that admission, /generate's replies and
    the static decoder's queue take stay free (a floor slept under one would hold it ~all the time)."""
    engine = engine_of(llama, decoder, 400.0)
    locks = [engine._lock] + ([engine._decoder._cond] if decoder == "static" else [])
    free = []

    def try_lock(lock) -> bool:  # acquired and released on one thread (the decoder's _cond wraps an RLock)
        got = lock.acquire(timeout=0.15)
        if got:
            lock.release()
        return got

    async def probe() -> None:
        await asyncio.sleep(0.1)  # inside the first pass, ~all of it spent in the floor
        for _ in range(4):
            for lock in locks:
                free.append(await asyncio.to_thread(try_lock, lock))
            await asyncio.sleep(0.07)

    try:
        generate(engine, 2, probe, tokens=3)  # 2 or 3 steps of 0.4 s; the probes take ~0.3 s
    finally:
        engine.shutdown()
    assert free and all(free), free


def test_server_info_reports_it_and_default_is_off(llama: str) -> None:
    engine = engine_of(llama, "static", 12.5)
    try:
        info = TestClient(build_app(engine)).get("/get_server_info").json()
        assert info["decode_step_ms"] == 12.5 and "floor_s" in info["step_profile"]
    finally:
        engine.shutdown()
    plain = LocalEngine(model_path=llama, seed=0, max_running_requests=2, context_length=32)
    try:
        assert TestClient(build_app(plain)).get("/get_server_info").json()["decode_step_ms"] == 0.0
        before = plain.step_profile.snapshot()["floor_s"]
        generate(plain, 1)
        assert plain.step_profile.snapshot()["floor_s"] == before == 0.0  # off: nothing slept
    finally:
        plain.shutdown()


@pytest.mark.parametrize("value", ["-1", "-0.5", "nan", "inf", "fast"])
def test_a_negative_or_non_finite_floor_is_refused(value: str, llama: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--model-path", llama, "--decode-step-ms", value])
    assert exit_info.value.code == 2
    assert "--decode-step-ms" in capsys.readouterr().err
    if value.startswith("-"):
        with pytest.raises(ValueError, match="--decode-step-ms must be"):
            LocalEngine(model_path=llama, decode_step_ms=float(value))
