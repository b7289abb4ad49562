"""LLMProxy over fake engines: least-loaded routing under a per-engine bound, queue scheduling,
exactly-once completion when an engine dies, re-admission, deliberate aborts, fan-out errors.
Timing is asserted through orderings and counts, never wall-clock thresholds."""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Awaitable, Callable, List

import pytest

from megatron_flash.engines.client import EngineClient, EngineHTTPError
from megatron_flash.rollout.proxy import EngineFanOutError, LLMProxy
from tests.unit.fake_engine import FakeEngine


def run_with_fakes(test: Callable[[List[FakeEngine], LLMProxy], Awaitable[Any]], *, num_engines: int = 2,
                   bound: int = 2, latency_s: Any = 0.05, **proxy_kwargs: Any) -> Any:
    async def main() -> Any:
        fakes = [FakeEngine(latency_s=latency_s) for _ in range(num_engines)]
        urls = [await f.start() for f in fakes]
        clients = [EngineClient(u, max_retries=0, control_timeout_s=5.0) for u in urls]
        proxy = LLMProxy(clients, max_inflight_per_engine=bound,
                         **{"health_check_interval_s": 0.05, **proxy_kwargs})
        try:
            async with proxy:
                return await asyncio.wait_for(test(fakes, proxy), 20)
        finally:
            for f in fakes:
                await f.close()

    return asyncio.run(main())


def latency_from_prompt(body: dict) -> float:
    """The fake sleeps input_ids[0] milliseconds: each test request carries its own latency."""
    return body["input_ids"][0] / 1000.0


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_least_loaded_routing_respects_the_bound() -> None:
    async def body(fakes: List[FakeEngine], proxy: LLMProxy) -> None:
        results = await asyncio.gather(*(proxy.generate([1], {"max_new_tokens": 2}, rid=f"r{i}")
                                         for i in range(20)))
        assert sorted(r.rid for r in results) == sorted(f"r{i}" for i in range(20))
        assert all(f.max_inflight <= 3 for f in fakes)  # what each engine saw at once
        assert all(len(f.completed) > 0 for f in fakes)
        m = proxy.metrics()
        assert m.completed == 20 and m.queue_len == 0 and m.retried == 0
        assert [e.max_inflight for e in m.engines] == [3, 3]
        assert all(0.0 < e.busy_fraction <= 1.0 for e in m.engines)
        assert all(abs(e.busy_fraction + e.idle_fraction - 1.0) < 1e-6 for e in m.engines)
        assert m.as_dict()["proxy/engine0/completed"] == m.engines[0].completed

    run_with_fakes(body, bound=3, latency_s=0.05)


def test_least_loaded_prefers_the_emptier_engine() -> None:
    async def body(fakes: List[FakeEngine], proxy: LLMProxy) -> None:
        slow = asyncio.ensure_future(proxy.generate([2000], {}, rid="slow"))
        await wait_until(lambda: sum(len(f.started) for f in fakes) == 1)
        busy = next(f for f in fakes if f.started)
        other = next(f for f in fakes if f is not busy)
        # 3 quick requests, one at a time: each goes to the engine with 0 in flight.
        for i in range(3):
            await proxy.generate([1], {}, rid=f"q{i}")
        assert other.completed == ["q0", "q1", "q2"] and busy.started == ["slow"]
        await proxy.abort("slow")
        assert (await slow).aborted

    run_with_fakes(body, bound=4, latency_s=latency_from_prompt)


def test_queue_scheduling_dispatches_when_a_slot_frees() -> None:
    """Bound 1, two engines, six requests: one long (r0), five short. Queue scheduling runs all the
    short ones on the free engine in submission order while the long one holds the other engine; a
    static round-robin would have put r2 and r4 behind r0."""

    async def body(fakes: List[FakeEngine], proxy: LLMProxy) -> None:
        done: List[str] = []

        async def one(i: int, ms: int) -> None:
            result = await proxy.generate([ms], {}, rid=f"r{i}")
            done.append(result.rid)

        tasks = [asyncio.ensure_future(one(0, 1500))]
        await wait_until(lambda: sum(len(f.started) for f in fakes) == 1)
        tasks += [asyncio.ensure_future(one(i, 60)) for i in range(1, 6)]
        await wait_until(lambda: proxy.metrics().queue_len == 4)
        await asyncio.gather(*tasks)
        long_engine = next(f for f in fakes if "r0" in f.started)
        short_engine = next(f for f in fakes if f is not long_engine)
        assert long_engine.started == ["r0"]
        assert short_engine.started == ["r1", "r2", "r3", "r4", "r5"]  # FIFO
        assert done == ["r1", "r2", "r3", "r4", "r5", "r0"]
        assert [f.max_inflight for f in fakes] == [1, 1]

    run_with_fakes(body, bound=1, latency_s=latency_from_prompt)


def test_exactly_once_when_an_engine_dies_mid_flight() -> None:
    async def body(fakes: List[FakeEngine], proxy: LLMProxy) -> None:
        n = 16
        tasks = [asyncio.ensure_future(proxy.generate([300], {}, rid=f"r{i}")) for i in range(n)]
        victim, survivor = fakes
        await wait_until(lambda: len(victim.started) >= 2)
        lost = set(victim.started) - set(victim.completed)  # in flight when it dies
        await victim.die()
        results = await asyncio.gather(*tasks)
        assert sorted(r.rid for r in results) == sorted(f"r{i}" for i in range(n))
        assert all(r.finish_reason == "length" and r.engine_url == survivor.url for r in results
                   if r.rid in lost)
        completed = collections.Counter(victim.completed + survivor.completed)
        assert set(completed) == {f"r{i}" for i in range(n)} and max(completed.values()) == 1
        assert set(lost).isdisjoint(victim.completed)
        m = proxy.metrics()
        assert m.retried == len(lost) and m.completed == n
        assert not m.engines[0].healthy and m.engines[0].failures == len(lost)
        assert "cannot reach the engine" in m.engines[0].unhealthy_reason

    run_with_fakes(body, bound=4, latency_s=latency_from_prompt)


def test_unhealthy_engine_is_readmitted_when_health_returns() -> None:
    async def body(fakes: List[FakeEngine], proxy: LLMProxy) -> None:
        victim, survivor = fakes
        await victim.die()
        results = await asyncio.gather(*(proxy.generate([1], {}, rid=f"a{i}") for i in range(4)))
        assert all(r.engine_url == survivor.url for r in results)
        assert not proxy.metrics().engines[0].healthy
        await victim.revive()
        await wait_until(lambda: proxy.metrics().engines[0].healthy)
        await asyncio.gather(*(proxy.generate([50], {}, rid=f"b{i}") for i in range(4)))
        assert len(victim.completed) == 2 and len(survivor.completed) == 6

    run_with_fakes(body, bound=2, latency_s=latency_from_prompt)


def test_engine_that_missed_a_weight_update_stays_out_until_synced() -> None:
    async def body(fakes: List[FakeEngine], proxy: LLMProxy) -> None:
        victim, survivor = fakes
        await victim.die()
        with pytest.raises(EngineFanOutError):
            await proxy.flush_cache()  # discovers the death
        survivor.weight_version = "1"  # the trainer's bridge pushed version 1 around the proxy
        proxy.note_external_sync("1")
        assert victim.weight_version == "0"
        await victim.revive()
        await wait_until(lambda: "weight_version '0' while the fleet is at '1'"
                         in proxy.metrics().engines[0].unhealthy_reason)
        assert not proxy.metrics().engines[0].healthy
        victim.weight_version = "1"  # synced out of band
        await wait_until(lambda: proxy.metrics().engines[0].healthy)

    run_with_fakes(body)


def test_all_engines_dead_fails_after_bounded_attempts() -> None:
    async def body(fakes: List[FakeEngine], proxy: LLMProxy) -> None:
        for f in fakes:
            await f.die()
        task = asyncio.ensure_future(proxy.generate([1], {}))
        await wait_until(lambda: not any(e.healthy for e in proxy.metrics().engines))
        for f in fakes:  # flapping back: the request is retried on them, then gives up
            f.fail["/generate"] = 503
            await f.revive()
        with pytest.raises(EngineHTTPError, match="HTTP 503"):
            await task
        assert sum(f.paths().count("/generate") for f in fakes) >= 1

    run_with_fakes(body, max_attempts=3)


def test_deliberate_abort_is_not_retried() -> None:
    async def body(fakes: List[FakeEngine], proxy: LLMProxy) -> None:
        task = asyncio.ensure_future(proxy.generate([5000], {}, rid="x"))
        await wait_until(lambda: sum(len(f.started) for f in fakes) == 1)
        assert await proxy.abort("x")
        result = await task
        assert result.aborted and result.finish_message == "Abort in running batch"
        assert sum(len(f.started) for f in fakes) == 1 and proxy.metrics().retried == 0
        assert not await proxy.abort("x")  # gone

    run_with_fakes(body, latency_s=latency_from_prompt)


def test_abort_of_a_queued_request_and_abort_all() -> None:
    async def body(fakes: List[FakeEngine], proxy: LLMProxy) -> None:
        running = asyncio.ensure_future(proxy.generate([5000], {}, rid="run"))
        queued = [asyncio.ensure_future(proxy.generate([1], {}, rid=f"q{i}")) for i in range(3)]
        await wait_until(lambda: proxy.metrics().queue_len == 3)
        assert await proxy.abort("q1")
        r = await queued[1]
        assert r.aborted and r.finish_message == "aborted by the proxy before dispatch" and r.engine_url == ""
        await proxy.abort_all()
        results = await asyncio.gather(running, queued[0], queued[2])
        assert all(r.aborted for r in results)
        assert fakes[0].started == ["run"] and fakes[0].paths()[-1] == "/abort_request"
        assert proxy.metrics().aborted == 3

    run_with_fakes(body, num_engines=1, bound=1, latency_s=latency_from_prompt)


def test_pause_holds_the_queue_and_continue_releases_it() -> None:
    async def body(fakes: List[FakeEngine], proxy: LLMProxy) -> None:
        await proxy.pause_generation("retract")
        assert [f.requests[-1]["body"] for f in fakes] == [{"mode": "retract"}] * 2
        tasks = [asyncio.ensure_future(proxy.generate([1], {}, rid=f"p{i}")) for i in range(3)]
        await wait_until(lambda: proxy.metrics().queue_len == 3)
        assert not any(f.started for f in fakes)
        await proxy.continue_generation()
        assert len(await asyncio.gather(*tasks)) == 3

    run_with_fakes(body)


def test_cancelled_caller_frees_its_slot() -> None:
    async def body(fakes: List[FakeEngine], proxy: LLMProxy) -> None:
        hog = asyncio.ensure_future(proxy.generate([5000], {}, rid="hog"))
        waiting = asyncio.ensure_future(proxy.generate([1], {}, rid="w"))
        await wait_until(lambda: proxy.metrics().queue_len == 1)
        waiting.cancel()
        hog.cancel()
        await asyncio.gather(hog, waiting, return_exceptions=True)
        m = proxy.metrics()
        assert m.queue_len == 0 and m.engines[0].inflight == 0
        # The running request is stopped on the engine too (its slot is free for the proxy), not only
        # its connection closed: SGLang notices a closed connection seconds later.
        await wait_until(lambda: any(r["path"] == "/abort_request" and r["body"].get("rid") == "hog"
                                     for r in fakes[0].requests))
        assert not any(r["path"] == "/abort_request" and r["body"].get("rid") == "w" for r in fakes[0].requests)
        assert (await proxy.generate([1], {}, rid="next")).rid == "next"

    run_with_fakes(body, num_engines=1, bound=1, latency_s=latency_from_prompt)


def test_fan_out_error_names_the_failed_engine() -> None:
    async def body(fakes: List[FakeEngine], proxy: LLMProxy) -> None:
        good, bad = fakes
        bad.fail["/pause_generation"] = 500
        with pytest.raises(EngineFanOutError) as info:
            await proxy.pause_generation("abort")
        message = str(info.value)
        assert message.startswith("pause_generation failed on 1 of 2 engines")
        assert f"{bad.url}/pause_generation: HTTP 500" in message and good.url not in message
        assert list(info.value.errors) == [bad.url] and list(info.value.results) == [good.url]
        # An HTTP error leaves the engine in rotation; only unreachable engines are taken out.
        assert all(e.healthy for e in proxy.metrics().engines)
        await proxy.continue_generation()
        await bad.die()
        with pytest.raises(EngineFanOutError, match=rf"flush_cache failed on 1 of 2 engines(.|\n)*{bad.url}"):
            await proxy.flush_cache()
        assert not proxy.metrics().engines[1].healthy
        assert list(await proxy.flush_cache()) == [good.url]  # the unhealthy one is skipped

    run_with_fakes(body)


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="at least one"):
        LLMProxy([], max_inflight_per_engine=1)
    with pytest.raises(ValueError, match="max_inflight_per_engine"):
        LLMProxy([EngineClient("http://a:1")], max_inflight_per_engine=0)
    with pytest.raises(ValueError, match="distinct"):
        LLMProxy([EngineClient("http://a:1"), EngineClient("http://a:1/")], max_inflight_per_engine=1)


# ---------------------------------------------------------------------------- parallel sampling (n)
def test_generate_n_occupies_n_slots_of_one_engine() -> None:
    """Bound 4 on two engines. An n=3 request holds 3 slots of one engine: a single request goes to
    the other engine (least loaded), the next n=3 request must wait until the first one ends, and a
    single request behind it in the queue does not overtake it (FIFO)."""

    async def body(fakes: List[FakeEngine], proxy: LLMProxy) -> None:
        first = asyncio.ensure_future(proxy.generate_n([300], {"max_new_tokens": 2}, 3, rid="n1"))
        await wait_until(lambda: sum(len(f.started) for f in fakes) == 1)
        a = next(f for f in fakes if f.started)
        b = next(f for f in fakes if f is not a)
        assert [e.inflight for e in proxy.metrics().engines] == [3 if f is a else 0 for f in fakes]
        single = asyncio.ensure_future(proxy.generate([300], {}, rid="s1"))
        await wait_until(lambda: b.started == ["s1"])
        # a has 1 free slot, b has 3: the second n=3 request fits on b only.
        second = asyncio.ensure_future(proxy.generate_n([300], {}, 3, rid="n2"))
        await wait_until(lambda: b.started == ["s1", "n2"])
        assert sorted(e.inflight for e in proxy.metrics().engines) == [3, 4]
        # Now neither engine has 3 free: n3 queues, and s2 (1 slot fits on a) waits behind it.
        third = asyncio.ensure_future(proxy.generate_n([10], {}, 3, rid="n3"))
        late = asyncio.ensure_future(proxy.generate([10], {}, rid="s2"))
        await wait_until(lambda: proxy.metrics().queue_len == 2)
        await asyncio.sleep(0.05)
        assert a.started == ["n1"] and proxy.metrics().queue_len == 2  # s2 did not take a's free slot
        results = await first
        assert [len(r.output_ids) for r in results] == [2, 2, 2] and len({r.rid for r in results}) == 3
        await asyncio.gather(single, second, third, late)
        assert a.started[0] == "n1" and sorted(a.started[1:]) == ["n3", "s2"]  # both got a's freed slots
        assert a.max_inflight <= 4 and b.max_inflight <= 4
        m = proxy.metrics()
        assert m.completed == 3 * 3 + 2 and m.queue_len == 0 and [e.inflight for e in m.engines] == [0, 0]

    run_with_fakes(body, bound=4, latency_s=latency_from_prompt)


def test_generate_n_larger_than_the_bound_waits_for_an_empty_engine() -> None:
    async def body(fakes: List[FakeEngine], proxy: LLMProxy) -> None:
        (engine,) = fakes
        busy = asyncio.ensure_future(proxy.generate([200], {}, rid="busy"))
        await wait_until(lambda: engine.started == ["busy"])
        big = asyncio.ensure_future(proxy.generate_n([1], {}, 5, rid="big"))
        await wait_until(lambda: proxy.metrics().queue_len == 1)
        await busy
        results = await big
        assert len(results) == 5 and engine.started == ["busy", "big"]
        assert proxy.metrics().engines[0].max_inflight == 2  # slots held: min(n, bound)
        assert engine.max_inflight == 5  # what the engine itself ran at once

    run_with_fakes(body, num_engines=1, bound=2, latency_s=latency_from_prompt)


def test_generate_n_is_retried_whole_when_its_engine_dies() -> None:
    async def body(fakes: List[FakeEngine], proxy: LLMProxy) -> None:
        task = asyncio.ensure_future(proxy.generate_n([400], {}, 4, rid="p"))
        await wait_until(lambda: sum(len(f.started) for f in fakes) == 1)
        victim = next(f for f in fakes if f.started)
        survivor = next(f for f in fakes if f is not victim)
        await victim.die()
        results = await task
        assert len(results) == 4 and all(r.engine_url == survivor.url and r.finish_reason == "length"
                                         for r in results)
        assert survivor.started == ["p"] and proxy.metrics().retried == 1
        assert [e.inflight for e in proxy.metrics().engines] == [0, 0]

    run_with_fakes(body, bound=4, latency_s=latency_from_prompt)


def test_abort_of_a_queued_generate_n_returns_n_aborted_results() -> None:
    async def body(fakes: List[FakeEngine], proxy: LLMProxy) -> None:
        hog = asyncio.ensure_future(proxy.generate([5000], {}, rid="hog"))
        queued = asyncio.ensure_future(proxy.generate_n([1], {}, 3, rid="q"))
        await wait_until(lambda: proxy.metrics().queue_len == 1)
        assert await proxy.abort("q")
        results = await queued
        assert [r.rid for r in results] == ["q_0", "q_1", "q_2"] and all(r.aborted for r in results)
        await proxy.abort("hog")
        await hog
        assert proxy.metrics().aborted == 3

    run_with_fakes(body, num_engines=1, bound=3, latency_s=latency_from_prompt)


@pytest.mark.parametrize("engine_aborts", [True, False])
def test_abort_of_a_running_generate_n(monkeypatch: pytest.MonkeyPatch, engine_aborts: bool) -> None:
    """The local engine ends all n on /abort_request {rid} (partial outputs come back). SGLang 0.5.23
    ignores it: after a grace period the proxy closes the connection (SGLang then aborts the samples)
    and answers n aborted results itself."""
    from megatron_flash.rollout import proxy as proxy_module

    monkeypatch.setattr(proxy_module, "N_ABORT_GRACE_S", 0.2)

    async def main() -> None:
        fake = FakeEngine(latency_s=latency_from_prompt, parallel_abort_by_rid=engine_aborts)
        url = await fake.start()
        try:
            async with LLMProxy([EngineClient(url, max_retries=0)], max_inflight_per_engine=4,
                                health_check_interval_s=0.05) as proxy:
                task = asyncio.ensure_future(proxy.generate_n([10_000], {}, 4, rid="p"))
                await wait_until(lambda: fake.started == ["p"])
                assert await proxy.abort("p")
                results = await asyncio.wait_for(task, 5)
                assert len(results) == 4 and all(r.aborted and r.engine_url == url for r in results)
                if engine_aborts:
                    assert [r.rid for r in results] == [f"p_{i}" for i in range(4)]
                    assert all(r.finish_message == "Abort in running batch" for r in results)
                    assert fake.aborted == ["p"] and fake.disconnected == []
                else:
                    assert all("connection was closed" in r.finish_message for r in results)
                    await wait_until(lambda: fake.disconnected == ["p"])
                m = proxy.metrics()
                assert m.engines[0].inflight == 0 and m.engines[0].healthy and m.retried == 0
                assert len(await proxy.generate_n([1], {}, 4)) == 4  # the slots are free again
        finally:
            await fake.close()

    asyncio.run(main())


def test_generate_n_validation() -> None:
    async def body(fakes: List[FakeEngine], proxy: LLMProxy) -> None:
        for bad in (0, -1, 2.0, True):
            with pytest.raises(ValueError, match="n must be a positive integer"):
                await proxy.generate_n([1], {}, bad)
        with pytest.raises(ValueError, match="contradicts n=2"):
            await proxy.generate_n([1], {"n": 3}, 2)
        (one,) = await proxy.generate_n([1], {"n": 1}, 1, rid="solo")  # n=1 is a plain generate
        assert one.rid == "solo" and "n" not in fakes[0].requests[-1]["body"]["sampling_params"]

    run_with_fakes(body, num_engines=1)


def test_an_engine_failed_by_an_external_sync_stays_out_until_it_reports_the_fleet_version() -> None:
    async def body(fakes: List[FakeEngine], proxy: LLMProxy) -> None:
        for f in fakes:
            f.weight_version = "3"
        fakes[1].weight_version = "2"  # the sync failed on engine 1: it still has (maybe partial) v2
        proxy.note_external_sync("3", failed={fakes[1].url: "bucket 4 timed out"})
        results = await asyncio.gather(*(proxy.generate([1], {"max_new_tokens": 2}, rid=f"x{i}") for i in range(8)))
        assert len(results) == 8 and not fakes[1].completed  # nothing routed to the failed engine
        await asyncio.sleep(0.3)  # health checks run every 0.05 s: /health is fine, the version is not
        m = proxy.metrics().engines[1]
        assert not m.healthy and "weight_version '2'" in m.unhealthy_reason
        fakes[1].weight_version = "3"  # re-synced elsewhere: re-admitted on the next check
        await wait_until(lambda: proxy.metrics().engines[1].healthy)

    run_with_fakes(body, latency_s=0.0)


def test_take_out_stops_routing_until_the_engine_reports_the_fleet_version() -> None:
    """An engine the launcher restarts comes back with the checkpoint's weights: taken out at once,
    it must stay out while it answers /health at an old version, and return once synced."""
    async def body(fakes: List[FakeEngine], proxy: LLMProxy) -> None:
        for f in fakes:
            f.weight_version = "5"
        proxy.note_external_sync("5")
        proxy.take_out(fakes[0].url, "engine 0 exited with code -9")
        with pytest.raises(ValueError, match="http://nowhere:1"):
            proxy.take_out("http://nowhere:1", "?")
        fakes[0].weight_version = "default"  # the restarted process: healthy, base weights
        results = await asyncio.gather(*(proxy.generate([1], {"max_new_tokens": 2}, rid=f"t{i}") for i in range(8)))
        assert len(results) == 8 and not fakes[0].completed
        await asyncio.sleep(0.3)
        m = proxy.metrics().engines[0]
        assert not m.healthy and "weight_version 'default'" in m.unhealthy_reason
        fakes[0].weight_version = "5"
        await wait_until(lambda: proxy.metrics().engines[0].healthy)

    run_with_fakes(body, latency_s=0.0)
