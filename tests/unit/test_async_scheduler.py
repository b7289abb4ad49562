"""The rollout scheduler + buffer + staleness manager driven by an in-process fake proxy and a fake
trainer thread (pure pieces: no HTTP, no Megatron). The e2e tests run the same code on real engines.

What is checked against independent computations:
  * α bound: over > 10⁴ simulated samples with random, long-tailed latencies and random train
    times, no trained sample has V − start > α (for several α, extra prompts, both stale policies).
  * α = 0 trains exactly the samples a plain synchronous loop (written here) trains.
  * partial rollout: a push in pause mode abort resubmits prompt + prefix; tokens keep versions.
  * filters, failing rewards and engine errors are counted and refilled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import re
import threading
import time
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch

from megatron_flash.buffer.sample_buffer import SampleBuffer
from megatron_flash.buffer.staleness import StalenessManager
from megatron_flash.engines.client import GenerateResult
from megatron_flash.rewards import RewardOutcome
from megatron_flash.rollout.scheduler import RolloutScheduler, SchedulerSettings


class Dataset:
    def __init__(self) -> None:
        self.i = 0

    def next_prompt(self) -> Any:
        p = SimpleNamespace(index=self.i, text=f"p{self.i}", prompt_ids=[1, 2 + self.i % 7], answer="x", meta={})
        self.i += 1
        return p


class Rewards:
    def __init__(self, fail_every: int = 0) -> None:
        self.calls = 0
        self.fail_every = fail_every

    async def score(self, text: str, answer: str, *, finished: bool, prompt: str = "", meta: Any = None) -> Any:
        self.calls += 1
        failed = bool(self.fail_every) and self.calls % self.fail_every == 0
        return RewardOutcome(0.0 if failed else float(sum(map(ord, text)) % 3), failed)


def route_of(token: int) -> list[int]:
    """The fake MoE engine's experts (2 layers × top-2) for a token: a function of the token alone."""
    return [token % 8, (token + 1) % 8, (token * 3) % 8, (token * 3 + 1) % 8]


def tokens_for(prompt_ids: list[int], version: int, sample: int, length: int) -> list[int]:
    """Deterministic 'generation': a function of the prompt, the weights and the sample index."""
    rng = random.Random(hash((tuple(prompt_ids), version, sample)))
    return [rng.randrange(3, 40) for _ in range(length)]


class FakeProxy:
    """generate() takes `latency(rid)` seconds; push(version, abort=True) ends in-flight requests
    with their partial output (pause mode abort) and switches the weights."""

    def __init__(self, latency, *, length: int = 6, fail_rids: tuple[str, ...] = (), routes: bool = False,
                 context: int = 0) -> None:
        self.latency, self.length, self.fail_rids = latency, length, set(fail_rids)
        self.context = context  # > 0: refuse (HTTP 400) a prompt longer than this, as an engine does
        self.routes = routes  # answer return_routed_experts (a MoE engine that records routes)
        self.version = 0
        self.inflight: dict[str, asyncio.Event] = {}
        self.requests: list[tuple[str, list[int]]] = []
        self.parallel: list[tuple[str, int]] = []  # generate_n calls: (rid, n)
        self.loop: Optional[asyncio.AbstractEventLoop] = None

    async def generate(self, input_ids, params, *, rid: str, return_logprob: bool = True,
                       return_routed_experts: bool = False) -> GenerateResult:
        self.loop = asyncio.get_running_loop()
        self.requests.append((rid, list(input_ids)))
        if rid in self.fail_rids:
            self.fail_rids.discard(rid)
            raise ConnectionError(f"engine lost {rid}")
        if self.context and input_ids[1] > self.context:  # the fake's "prompt length": its second id
            from megatron_flash.engines.client import EngineHTTPError

            raise EngineHTTPError("http://fake:1", "/generate", 400,
                                  f'{{"error": {{"message": "input is longer than the context ({self.context})"}}}}')
        sample = int(rid.split("-s")[1].split("-")[0])
        want = params["max_new_tokens"]
        version = self.version
        ids = tokens_for(input_ids, version, sample, min(want, self.length))
        ev = asyncio.Event()
        self.inflight[rid] = ev
        duration = self.latency(rid)
        try:
            await asyncio.wait_for(ev.wait(), timeout=duration)
            aborted = True
        except asyncio.TimeoutError:
            aborted = False
        finally:
            self.inflight.pop(rid, None)
        if aborted:  # a push cut it: half of its tokens were produced (deterministic for the tests)
            ids = ids[:len(ids) // 2]
        routes = None
        if return_routed_experts and self.routes and not aborted:
            routes = torch.tensor([route_of(t) for t in (list(input_ids) + ids)[:-1]], dtype=torch.uint8)
        return GenerateResult(rid=rid, output_ids=ids, output_logprobs=[-0.5] * len(ids),
                              finish_reason="abort" if aborted else ("length" if len(ids) == want else "stop"),
                              weight_version=str(version), engine_url="http://fake:1", routed_experts=routes)

    async def generate_n(self, input_ids, params, n: int, *, rid: str, return_logprob: bool = True,
                         return_routed_experts: bool = False):
        """SGLang `n`: here n sequential samples numbered from the chunk's first index ("g3-c4" → 4)."""
        self.parallel.append((rid, n))
        group, _, first = rid.partition("-c")
        return [await self.generate(input_ids, params, rid=f"{group}-s{int(first or 0) + i}-r0",
                                    return_routed_experts=return_routed_experts) for i in range(n)]

    async def abort_all(self) -> None:
        for ev in list(self.inflight.values()):
            ev.set()

    def push(self, version: int, *, abort: bool) -> None:
        def go() -> None:
            if abort:
                for ev in list(self.inflight.values()):
                    ev.set()
            self.version = version
        if self.loop is None:
            self.version = version
            return
        done = threading.Event()
        self.loop.call_soon_threadsafe(lambda: (go(), done.set()))
        done.wait(5)


@dataclasses.dataclass
class Harness:
    scheduler: RolloutScheduler
    buffer: SampleBuffer
    staleness: StalenessManager
    proxy: FakeProxy
    thread: threading.Thread


def start(*, alpha: int, batch: int, n: int, proxy: FakeProxy, extra: int = 0, stale_policy: str = "drop",
          replication: bool = True, group_filter=lambda r: True, rewards: Optional[Rewards] = None,
          max_new_tokens: int = 6, chunk: int = 1, routes: bool = False, overlong: tuple[int, float] = (0, 1.0),
          dataset: Any = None, admission: str = "eager", down_s: float = 120.0) -> Harness:
    m = StalenessManager(alpha=alpha, batch_size=batch, extra=extra * n, admission=admission)
    holder: dict[str, RolloutScheduler] = {}
    buf = SampleBuffer(m, stale_policy=stale_policy,
                       on_evict=lambda g: holder["s"].requeue_prompt(g) if stale_policy == "regenerate" else None)
    s = RolloutScheduler(dataset=dataset or Dataset(), proxy=proxy, reward_pool=rewards or Rewards(), group_filter=group_filter,
                         buffer=buf, staleness=m,
                         settings=SchedulerSettings(n_samples_per_prompt=n, sampling_params={"temperature": 1.0},
                                                    max_new_tokens=max_new_tokens, prompt_replication=replication,
                                                    replication_chunk=chunk, return_routed_experts=routes,
                                                    overlong_buffer_len=overlong[0], overlong_penalty=overlong[1],
                                                    engine_down_deadline_s=down_s),
                         decode=lambda ids: "".join(chr(97 + i % 26) for i in ids), poll_s=0.001)
    holder["s"] = s
    t = threading.Thread(target=lambda: asyncio.run(s.run()), daemon=True)
    t.start()
    return Harness(s, buf, m, proxy, t)


def quiesce(h: Harness, timeout_s: float = 30.0) -> None:
    """Wait until the rollout is at rest: nothing in flight and no room to admit more (the buffer holds
    what α allows). A request that fails after stop() counts as cancelled, not as a failure of its
    prompt, so tests that match the scheduler's counts with the requests an engine saw stop only here."""
    deadline, quiet_since = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        if h.staleness.in_flight_through(1 << 30) == 0 and h.staleness.capacity() <= 0:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= 0.05:
                return
        else:
            quiet_since = None
        time.sleep(0.005)
    raise AssertionError("the rollout did not come to rest")


def train(h: Harness, steps: int, *, batch: int, alpha: int, train_s=lambda: 0.0, abort: bool = False,
          settle=lambda: None):
    """The fake trainer: take a batch, check the bound, 'train', push. Returns per-step groups.
    `settle` runs after the last step, before the scheduler is stopped."""
    taken = []
    for step in range(steps):
        groups = h.buffer.take_batch(batch, timeout_s=30, poll_s=0.005)
        v = h.staleness.version
        assert v == step
        for g in groups:
            for s in g.samples:
                assert 0 <= v - s.version_start <= alpha, (v, s.version_start)
        taken.append(groups)
        time.sleep(train_s())
        h.proxy.push(step + 1, abort=abort)
        h.staleness.set_version(step + 1)
    settle()
    h.scheduler.stop()
    h.thread.join(30)
    assert not h.thread.is_alive()
    return taken


@pytest.mark.parametrize("alpha, extra, stale_policy, admission", [
    (0, 0, "drop", "eager"), (1, 2, "drop", "eager"), (2, 4, "regenerate", "eager"), (3, 0, "drop", "eager"),
    (2, 0, "drop", "adaptive"), (3, 2, "regenerate", "adaptive"), (2, 0, "drop", "tokens"),
    (3, 2, "regenerate", "tokens")])
def test_no_sample_trained_beyond_alpha_over_ten_thousand_samples(alpha, extra, stale_policy, admission) -> None:
    rng = random.Random(alpha * 100 + extra)
    lock = threading.Lock()

    def latency(rid: str) -> float:  # long tail: 10% of requests take 5-20x longer
        with lock:
            base = rng.uniform(0.0, 0.002)
            return base * rng.uniform(5, 20) if rng.random() < 0.1 else base

    batch, n = 64, 4
    steps = 10_000 // batch + 2
    h = start(alpha=alpha, batch=batch, n=n, proxy=FakeProxy(latency), extra=extra, stale_policy=stale_policy,
              admission=admission)
    taken = train(h, steps, batch=batch, alpha=alpha, train_s=lambda: rng.uniform(0, 0.004), abort=alpha % 2 == 1)
    trained = sum(len(g) for gs in taken for g in gs)
    assert trained == steps * batch >= 10_000
    lags = [st - s.version_start for st, gs in enumerate(taken) for g in gs for s in g.samples]
    assert max(lags) <= alpha
    if alpha > 0:
        assert max(lags) >= 1  # the pipeline really overlapped (not secretly synchronous)
    c = h.staleness.counters
    assert c.submitted >= c.consumed == trained
    if extra == 0 and stale_policy == "drop":
        assert c.dropped_stale == 0  # admission control alone keeps everything trainable


def test_alpha_zero_trains_exactly_what_a_synchronous_loop_trains() -> None:
    batch, n, steps = 8, 4, 6
    rng = random.Random(0)
    h = start(alpha=0, batch=batch, n=n, proxy=FakeProxy(lambda rid: rng.uniform(0, 0.003)))
    taken = train(h, steps, batch=batch, alpha=0)

    # The plain synchronous loop: step k generates for the next batch/n prompts with weights k.
    ds = Dataset()
    for k in range(steps):
        expected = set()
        for _ in range(batch // n):
            p = ds.next_prompt()
            for i in range(n):
                expected.add((p.index, tuple(tokens_for(p.prompt_ids, k, i, 6))))
        got = {(s.prompt_index, tuple(s.response_ids)) for g in taken[k] for s in g.samples}
        assert got == expected, f"step {k}"
        assert all(s.version_start == k and s.version_end == k for g in taken[k] for s in g.samples)


def test_pause_abort_resumes_from_the_prefix_with_per_token_versions() -> None:
    # First segments would take 30 s: the push lands while all 8 admitted requests are in flight.
    h = start(alpha=1, batch=4, n=2, proxy=FakeProxy(lambda rid: 30.0 if rid.endswith("-r0") else 0.01))
    deadline = time.monotonic() + 10
    while len(h.proxy.inflight) < 8 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(h.proxy.inflight) == 8
    # Version first, then the abort: a resubmitted segment then provably runs under version 1 (the
    # other order leaves it unknown — None — unless the engine reports per-token version spans).
    h.staleness.set_version(1)
    h.proxy.push(1, abort=True)
    groups = h.buffer.take_batch(4, timeout_s=10, poll_s=0.005)
    h.scheduler.stop()
    h.thread.join(10)
    for g in groups:
        for s in g.samples:
            assert s.num_resumes == 1 and s.version_start == 0 and len(s.response_ids) == 6
            assert s.token_versions == [0, 0, 0, 1, 1, 1]
    resumed = [(rid, ids) for rid, ids in h.proxy.requests if rid.endswith("-r1")]
    assert resumed
    for rid, ids in resumed:  # prompt + the generated prefix, as the first segment produced it
        first = next(i for r, i in h.proxy.requests if r == rid[:-1] + "0")
        assert ids[:len(first)] == first and len(ids) > len(first)


def test_filter_and_failed_rewards_are_dropped_counted_and_refilled() -> None:
    h = start(alpha=1, batch=8, n=2, proxy=FakeProxy(lambda rid: 0.001), rewards=Rewards(fail_every=7),
              group_filter=lambda rewards: rewards[0] != rewards[1])
    taken = train(h, 5, batch=8, alpha=1)
    for gs in taken:
        for g in gs:
            assert g.rewards[0] != g.rewards[1]
            assert not any(s.reward_failed for s in g.samples)
    c = h.staleness.counters
    assert c.dropped_filtered > 0 and c.dropped_failed > 0
    assert c.consumed == 40
    lengths = h.staleness.take_drop_lengths()  # length-bias diagnostics: what the filter took away
    assert lengths["filtered"] == [6] * c.dropped_filtered and "failed" not in lengths
    assert h.staleness.take_drop_lengths() == {}  # a window: taken once


class HangingRewards(Rewards):
    """Every 3rd call fails, every 5th of those by its deadline (what RewardPool reports for each)."""

    async def score(self, text: str, answer: str, *, finished: bool, prompt: str = "", meta: Any = None) -> Any:
        self.calls += 1
        if self.calls % 3:
            return RewardOutcome(1.0, False)
        return RewardOutcome(0.0, True, "timed out", timed_out=self.calls % 15 == 0)


def test_reward_errors_and_timeouts_are_counted_per_call() -> None:
    """reward_failed counts the samples of dropped groups; reward_errors and reward_timeouts count the
    failed calls themselves, once each, so a run can match every injected reward fault (the soak)."""
    h = start(alpha=1, batch=8, n=2, proxy=FakeProxy(lambda rid: 0.001), rewards=HangingRewards())
    train(h, 3, batch=8, alpha=1)  # stops the scheduler: every call made has been counted
    calls, stats = h.scheduler.reward_pool.calls, h.scheduler.stats
    assert stats.reward_timeouts == calls // 15 >= 1
    assert stats.reward_errors == calls // 3 - calls // 15 >= 1


class OverflowingRewards(Rewards):
    """Every 5th call returns a finite but overflowing reward (not a failure the pool reports)."""

    async def score(self, text: str, answer: str, *, finished: bool, prompt: str = "", meta: Any = None) -> Any:
        self.calls += 1
        reward = 1e308 if self.calls % 5 == 0 else float(self.calls % 2)
        return RewardOutcome(reward, False)


def test_an_overflowing_reward_drops_its_group_counted_never_trained(caplog) -> None:
    from megatron_flash.types import REWARD_LIMIT

    h = start(alpha=1, batch=8, n=2, proxy=FakeProxy(lambda rid: 0.001), rewards=OverflowingRewards())
    with caplog.at_level("WARNING", logger="megatron_flash.rollout.filters"):
        taken = train(h, 4, batch=8, alpha=1)
    assert all(abs(s.reward) <= 1 for gs in taken for g in gs for s in g.samples)
    calls, stats, c = h.scheduler.reward_pool.calls, h.scheduler.stats, h.staleness.snapshot()
    # every 5th of the scored samples overflowed (a group's two samples are scored before it is judged)
    assert stats.reward_overflow >= 4 and stats.reward_overflow <= calls // 5
    assert stats.reward_errors == stats.reward_timeouts == 0  # nothing else failed
    # each overflowing sample takes its whole group (2 samples) into reward_failed; identity of the row
    assert stats.reward_overflow <= c.dropped_failed <= 2 * stats.reward_overflow and c.dropped_failed % 2 == 0
    assert c.submitted == (c.consumed + c.outstanding + c.dropped_stale + c.regenerated_stale + c.dropped_filtered
                           + c.dropped_failed + c.dropped_error + c.skipped + c.cancelled)
    assert any("1e+308" in r.getMessage() and f"{REWARD_LIMIT:g}" in r.getMessage() for r in caplog.records)


def test_length_bias_metrics_hand_values() -> None:
    from types import SimpleNamespace

    from megatron_flash.recipes import length_bias

    trained = [SimpleNamespace(response_ids=[0] * n) for n in (2, 4, 6, 8, 10)]
    m = length_bias(trained, {"stale": [30, 10, 20]})
    assert m["len_trained_mean"] == 6 and m["len_trained_p90"] == 10 and m["len_trained_n"] == 5
    assert m["len_dropped_stale_mean"] == 20 and m["len_dropped_stale_p90"] == 30 and m["len_dropped_stale_n"] == 3
    assert m["len_dropped_filtered_mean"] is None and m["len_dropped_filtered_n"] == 0


def test_engine_error_requeues_the_prompt() -> None:
    h = start(alpha=0, batch=4, n=2, proxy=FakeProxy(lambda rid: 0.001, fail_rids=("g0-s1-r0",)))
    taken = train(h, 2, batch=4, alpha=0)
    indices = sorted(g.prompt_index for g in taken[0])
    assert indices == [0, 1]  # prompt 0 came back after its group failed
    assert h.staleness.counters.dropped_error == 2


def test_surplus_groups_in_flight_are_cancelled_at_the_push_and_counted_stale() -> None:
    """Redundant prompts at α = 0: B = 4 (2 groups of 2) plus 2 surplus groups. Group 3's requests
    never finish on their own (an hour): the trainer takes the first full batch, pushes, and the
    scheduler cancels what is still in flight from version 0 — the proxy sees the cancellation,
    the group counts as stale, and rollout capacity comes back for version 1."""
    slow = {"g3-s0-r0", "g3-s1-r0"}
    proxy = FakeProxy(lambda rid: 3600.0 if rid in slow else 0.001)
    cancelled: list[str] = []
    generate = proxy.generate

    async def tracking_generate(input_ids, params, *, rid: str, return_logprob: bool = True):
        try:
            return await generate(input_ids, params, rid=rid, return_logprob=return_logprob)
        except asyncio.CancelledError:
            cancelled.append(rid)
            raise

    proxy.generate = tracking_generate  # type: ignore[method-assign]
    h = start(alpha=0, batch=4, n=2, proxy=proxy, extra=2)
    first = h.buffer.take_batch(4, timeout_s=30, poll_s=0.005)
    assert all(s.version_start == 0 for g in first for s in g.samples)
    assert 3 not in {g.group_id for g in first}
    h.proxy.push(1, abort=False)
    h.staleness.set_version(1)
    second = h.buffer.take_batch(4, timeout_s=30, poll_s=0.005)  # needs capacity freed by the cancel
    assert all(s.version_start == 1 for g in second for s in g.samples)
    h.scheduler.stop()
    h.thread.join(30)
    assert sorted(cancelled) == sorted(slow)
    assert h.staleness.counters.dropped_stale >= 2  # group 3 (and any other surplus of version 0)
    assert h.scheduler.stats.groups_expired >= 1


@pytest.mark.parametrize("replication, chunk, expected", [(True, 3, [("0", 3), ("3", 3), ("6", 2)]),
                                                          (False, 1, [("", 8)])])
def test_replication_in_chunks_numbers_every_sample_once(replication, chunk, expected) -> None:
    """n = 8 with replication_chunk 3: three requests of 3, 3 and 2 samples (spread over engines);
    replication off: one request of 8. Either way a group holds samples 0..7 exactly once, each the
    deterministic generation of its own index (under the weights it was generated with)."""
    h = start(alpha=1, batch=16, n=8, proxy=FakeProxy(lambda rid: 0.001), replication=replication, chunk=chunk)
    taken = train(h, 3, batch=16, alpha=1)
    ds = Dataset()
    prompts = {p.index: p for p in (ds.next_prompt() for _ in range(64))}
    for g in (g for gs in taken for g in gs):
        calls = sorted((rid.partition("-c")[2], k) for rid, k in h.proxy.parallel
                       if rid.partition("-c")[0] == f"g{g.group_id}")
        assert calls == sorted(expected)
        p = prompts[g.prompt_index]
        indices = [[i for i in range(8) if tokens_for(p.prompt_ids, s.version_end, i, 6) == s.response_ids]
                   for s in g.samples]
        assert sorted(i for found in indices for i in found) == list(range(8))


@pytest.mark.parametrize("replication", [True, False])
def test_samples_carry_the_routes_of_their_last_request_across_resumes(replication) -> None:
    slow = {"before_push": True}  # requests started before the push wait for it; later ones are quick
    h = start(alpha=1, batch=4, n=2, replication=replication, routes=True,
              proxy=FakeProxy(lambda rid: 30.0 if slow["before_push"] else 0.01, routes=True))
    deadline = time.monotonic() + 10
    while len(h.proxy.inflight) < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    slow["before_push"] = False
    h.staleness.set_version(1)
    h.proxy.push(1, abort=True)  # every first request is cut: routes come from the resumed one
    groups = h.buffer.take_batch(4, timeout_s=10, poll_s=0.005)
    h.scheduler.stop()
    h.thread.join(10)
    resumed = 0
    for g in groups:
        for s in g.samples:
            tokens = s.prompt_ids + s.response_ids
            resumed += s.num_resumes
            assert s.routed_experts.tolist() == [route_of(t) for t in tokens[:-1]]
    assert resumed >= 2  # some came from a request that continued a cut prefix


def test_the_down_deadline_fires_while_requests_wait_without_failing_again() -> None:
    """One request fails, every other one waits for an engine that never answers (all engines out of
    routing: the proxy holds requests, it does not fail them): the run stops by engine_down_deadline_s."""
    from megatron_flash.buffer.sample_buffer import BufferClosed

    h = start(alpha=1, batch=4, n=2, down_s=0.5, proxy=FakeProxy(lambda rid: 1000.0, fail_rids=("g0-s0-r0",)))
    t0 = time.monotonic()
    with pytest.raises(BufferClosed) as stopped:
        h.buffer.take_batch(4, timeout_s=30, poll_s=0.005)
    assert time.monotonic() - t0 < 10
    assert "no rollout request succeeded for 0 s (engines down?); last error: engine lost g0-s0-r0" in \
        str(stopped.value.__cause__)
    h.scheduler.stop()
    h.thread.join(10)


def test_an_engine_without_routes_stops_the_run_naming_it_and_the_flag() -> None:
    h = start(alpha=1, batch=4, n=2, routes=True, proxy=FakeProxy(lambda rid: 0.001, routes=False))
    from megatron_flash.buffer.sample_buffer import BufferClosed

    with pytest.raises(BufferClosed) as stopped:  # the trainer's wait ends with the cause chained
        h.buffer.take_batch(4, timeout_s=10, poll_s=0.005)
    assert re.search(r"http://fake:1.*--enable-return-routed-experts", str(stopped.value.__cause__))
    h.scheduler.stop()
    h.thread.join(10)
    assert not h.thread.is_alive()
    h.scheduler.stop()  # the trainer's shutdown after the loop ended (and closed): nothing to wake, no error


@pytest.mark.parametrize("length, expected_penalty", [(2, 0.0), (4, 0.75), (5, 1.125), (6, 1.5)])
def test_overlong_penalty_is_dapos_linear_ramp_over_the_buffer(length, expected_penalty) -> None:
    """max_new_tokens 6, buffer 4, penalty 1.5: free up to 2 tokens, then 1.5 × (excess / 4)."""
    h = start(alpha=0, batch=4, n=2, proxy=FakeProxy(lambda rid: 0.0, length=length), overlong=(4, 1.5))
    taken = train(h, 2, batch=4, alpha=0)
    samples = [s for gs in taken for g in gs for s in g.samples]
    for s in samples:
        text = "".join(chr(97 + i % 26) for i in s.response_ids)
        assert len(s.response_ids) == length
        assert s.reward == pytest.approx(float(sum(map(ord, text)) % 3) - expected_penalty)
    assert h.scheduler.stats.overlong_penalized >= (len(samples) if expected_penalty else 0)
    assert (h.scheduler.stats.overlong_penalized == 0) == (expected_penalty == 0)


def test_overlong_penalty_function_hand_values() -> None:
    from megatron_flash.rollout.scheduler import overlong_penalty

    kw = dict(max_new_tokens=100, buffer_len=20, penalty=1.0)
    assert overlong_penalty(80, **kw) == 0.0 and overlong_penalty(90, **kw) == 0.5
    assert overlong_penalty(100, **kw) == 1.0 and overlong_penalty(81, **kw) == pytest.approx(0.05)
    assert overlong_penalty(100, max_new_tokens=100, buffer_len=0, penalty=1.0) == 0.0


def test_a_prompt_the_engine_refuses_is_skipped_counted_and_never_sent_again() -> None:
    """Prompts whose second id is 7 or 8 (indices ≡ 5, 6 mod 7) are 'too long' for the fake engine:
    refused once, skipped, and the run trains on the others. Asking again would get the same 400."""
    proxy = FakeProxy(lambda rid: 0.0, context=6)
    h = start(alpha=1, batch=8, n=2, proxy=proxy)

    taken = train(h, 6, batch=8, alpha=1, settle=lambda: quiesce(h))
    trained = {g.prompt_index for gs in taken for g in gs}
    refused = {int(rid.split("-")[0][1:]) for rid, ids in proxy.requests if ids[1] > 6}
    assert refused and not trained & refused
    # every refused prompt went out as exactly one group (its n samples), never re-queued (no error drop)
    assert h.scheduler.stats.skipped_prompts == len({rid.split("-")[0] for rid, ids in proxy.requests if ids[1] > 6})
    assert h.staleness.counters.skipped == 2 * h.scheduler.stats.skipped_prompts
    assert h.staleness.counters.dropped_error == 0


class TinyDataset(Dataset):
    def __len__(self) -> int:
        return 3

    def next_prompt(self) -> Any:
        p = SimpleNamespace(index=self.i % 3, text="p", prompt_ids=[1, 9, 9, 9], answer="x", meta={})
        self.i += 1
        return p


def test_a_dataset_the_engine_refuses_entirely_stops_the_run_naming_prompt_length_and_reason() -> None:
    from megatron_flash.buffer.sample_buffer import BufferClosed

    h = start(alpha=0, batch=4, n=2, proxy=FakeProxy(lambda rid: 0.0, context=6), dataset=TinyDataset())
    with pytest.raises(BufferClosed) as info:
        h.buffer.take_batch(4, timeout_s=30, poll_s=0.005)
    message = str(info.value.__cause__ or info.value)
    assert "every prompt of the dataset (3) was refused" in message and "prompt " in message
    assert "(4 tokens)" in message and "longer than the context (6)" in message
    h.thread.join(30)


class IndexedDataset(Dataset):
    """Dataset's prompts with their index as a third id, so an engine can tell them apart."""

    def next_prompt(self) -> Any:
        p = super().next_prompt()
        p.prompt_ids = p.prompt_ids + [100 + p.index]
        return p


class CrashingProxy(FakeProxy):
    """An engine that answers HTTP 500 to every prompt whose second id is 5 (indices ≡ 3 mod 7),
    as a server does on an input that crashes it: a failure that is not a refusal, and repeats."""

    async def generate(self, input_ids, params, *, rid: str, **kw) -> GenerateResult:
        if input_ids[1] == 5:
            from megatron_flash.engines.client import EngineHTTPError

            self.requests.append((rid, list(input_ids)))
            raise EngineHTTPError("http://fake:1", "/generate", 500, "internal error")
        return await super().generate(input_ids, params, rid=rid, **kw)


def test_a_prompt_that_keeps_failing_is_retried_a_bounded_number_of_times_then_skipped() -> None:
    proxy = CrashingProxy(lambda rid: 0.0)
    h = start(alpha=1, batch=8, n=2, proxy=proxy, dataset=IndexedDataset())
    retries = h.scheduler.settings.max_prompt_retries

    taken = train(h, 8, batch=8, alpha=1, settle=lambda: quiesce(h))
    trained = {g.prompt_index for gs in taken for g in gs}
    groups_of: dict[int, set] = {}  # failing prompt → the groups (attempts) it went out as
    for rid, ids in proxy.requests:
        if ids[1] == 5:
            groups_of.setdefault(ids[2] - 100, set()).add(rid.split("-")[0])
    assert groups_of and not trained & set(groups_of)
    assert max(len(g) for g in groups_of.values()) == retries + 1  # never more tries than the bound
    skipped = [p for p, g in groups_of.items() if len(g) == retries + 1]
    stats = h.scheduler.stats
    assert stats.skipped_after_retries == stats.skipped_prompts == len(skipped) >= 1
    assert h.staleness.counters.skipped == 2 * len(skipped)
    assert stats.engine_errors == sum(len(g) for g in groups_of.values())
    assert all(p in h.scheduler._refused for p in skipped)  # never drawn again


def test_a_duplicate_request_id_refusal_is_transient_not_the_prompts_fault() -> None:
    """After a timeout the proxy re-sends the same rid; an engine still running the first copy refuses
    it as a duplicate (SGLang: HTTP 400). That says nothing about the prompt: the group is retried,
    not skipped, unlike a refusal of the prompt itself."""
    from megatron_flash.engines.client import EngineHTTPError
    from megatron_flash.rollout.scheduler import deterministic_refusal

    duplicate = EngineHTTPError("http://e:1", "/generate", 400,
                                '{"error":{"message":"Duplicate request ID detected: g8-s7-r0"}}')
    too_long = EngineHTTPError("http://e:1", "/generate", 400, '{"error":{"message":"input is longer than the context"}}')
    assert deterministic_refusal(duplicate) is None
    assert deterministic_refusal(too_long) is too_long
    try:
        raise RuntimeError("group failed") from duplicate
    except RuntimeError as wrapped:
        assert deterministic_refusal(wrapped) is None


class _UnreachableProxy(FakeProxy):
    """An engine host whose link is cut: requests hang and the abort cannot reach it."""

    async def abort_all(self) -> None:
        raise ConnectionError("engine host unreachable")


def test_stop_on_an_unreachable_engine_cancels_after_a_short_grace_not_the_full_drain() -> None:
    from megatron_flash.rollout import scheduler as scheduler_module

    proxy = _UnreachableProxy(lambda rid: 3600.0)
    h = start(alpha=1, batch=2, n=2, proxy=proxy)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(proxy.inflight) < 2:
        time.sleep(0.005)
    assert len(proxy.inflight) >= 2  # requests are hanging on the dead link
    h.scheduler.stop()
    # The full drain (30 s) would still be waiting long after this; the grace after a failed abort is 2 s.
    h.thread.join(scheduler_module.DRAIN_TIMEOUT_S / 2)
    assert not h.thread.is_alive()
    assert proxy.inflight == {}  # every hanging request was cancelled, none left behind
