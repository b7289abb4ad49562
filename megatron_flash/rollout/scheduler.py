"""The rollout side of the async loop: prompts → requests → rewards → groups → buffer. Never waits
for training; only admission control (staleness.py) throttles it.

    dataset ─► admission (capacity ≥ n) ─► group task ─┬─ n requests (prompt replication) ─┐
                                                       └─ 1 request with n (replication off)┤
                         proxy (queue scheduling: a request goes out the moment a slot frees) ◄┘
    each response ─► reward, the moment it ends ─► group complete ─► filter ─► SampleBuffer.put

Partial rollout at a weight push: with pause mode `abort` the engines end in-flight requests with
their partial output; the sample's task resubmits prompt + generated prefix with the remaining
budget (tokens keep their own versions). With `retract`/`in_place` requests simply finish after the
push (their tokens span two versions; the sample's start version stays the older one).

Prompts whose groups failed on engine errors, or turned stale under `stale_policy=regenerate`, go to
the front of the prompt queue. Everything here runs in one asyncio loop (one thread).

Redundant prompts (`extra` > 0) let the trainer take a full batch without waiting for slower groups
(SampleBuffer.take_batch). A group still generating when a push makes it untrainable (start
< V − α) is then surplus: its task is cancelled the moment the loop sees the new version (the proxy
aborts its engine requests), and it is counted as stale (or its prompt re-queued under
`stale_policy=regenerate`) — engine slots and admission capacity free at once instead of finishing
work that would be evicted on arrival.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
import uuid
from typing import Any, Callable, Deque, Optional, Sequence

from megatron_flash.buffer.sample_buffer import SampleBuffer
from megatron_flash.buffer.staleness import StalenessManager
from megatron_flash.rollout.filters import overflowing_rewards
from megatron_flash.rollout.group_runner import GroupDropped, GroupRunner
from megatron_flash.counters import Counters
from megatron_flash.engines.client import version_number
from megatron_flash.engines.client_base import deterministic_refusal
from megatron_flash.trace import tag_requests
from megatron_flash.types import Group, Sample

logger = logging.getLogger(__name__)
# At stop: the wait for aborted requests' partial outputs; a short grace when the abort failed.
DRAIN_TIMEOUT_S, DRAIN_AFTER_FAILED_ABORT_S = 30.0, 2.0


class RolloutError(RuntimeError):
    """The rollout side cannot go on (engines down past the deadline, a resume loop, ...)."""


@dataclasses.dataclass
class SchedulerSettings:
    n_samples_per_prompt: int
    sampling_params: dict[str, Any]
    max_new_tokens: int
    prompt_replication: bool = True
    replication_chunk: int = 1
    """With replication: samples per request (1 = one request per sample)."""
    max_resumes: int = 16
    engine_down_deadline_s: float = 120.0
    """Stop the run when no request succeeded for this long while requests fail (or below engines.min_engines)."""
    return_routed_experts: bool = False
    """Ask the engines for the MoE experts of every token (routing replay); a reply without them stops the run."""
    overlong_buffer_len: int = 0
    overlong_penalty: float = 1.0  # DAPO's soft overlong penalty (see `overlong_penalty`)
    max_prompt_retries: int = 3
    """Times a prompt whose group failed on the engines is re-queued before it is skipped."""


def overlong_penalty(length: int, *, max_new_tokens: int, buffer_len: int, penalty: float) -> float:
    """DAPO's soft overlong punishment, as a positive amount to subtract from the reward: 0 up to
    max_new_tokens − buffer_len, then linear up to `penalty` at max_new_tokens."""
    if buffer_len <= 0:
        return 0.0
    excess = length - (max_new_tokens - buffer_len)
    return penalty * min(1.0, excess / buffer_len) if excess > 0 else 0.0


@dataclasses.dataclass
class RolloutStats(Counters):
    """Counters since the last `take()` (a metrics window); only the loop thread writes them."""

    requests: int = 0
    tokens_generated: int = 0
    resumes: int = 0
    engine_errors: int = 0
    reward_errors: int = 0  # failed reward calls but timeouts, per call whatever became of the group
    reward_timeouts: int = 0  # reward calls past rollout.reward_timeout_s, per call
    reward_overflow: int = 0  # rewards beyond ±types.REWARD_LIMIT or not finite (their groups: reward_failed)
    groups_finished: int = 0
    groups_filtered: int = 0
    groups_expired: int = 0  # surplus groups (redundant prompts) cancelled in flight: a push made them stale
    group_latency_s: float = 0.0
    skipped_prompts: int = 0
    """Prompts skipped for good: refused by an engine (HTTP 4xx: too long, bad parameters; never
    retried) or failed on the engines max_prompt_retries + 1 times (`skipped_after_retries` of them)."""
    skipped_after_retries: int = 0
    overlong_penalized: int = 0
    """Responses whose reward lost an overlong penalty."""
    overlong_penalty_sum: float = 0.0


class RolloutScheduler:
    def __init__(self, *, dataset: Any, proxy: Any, reward_pool: Any, group_filter: Callable[[Sequence[float]], bool],
                 buffer: SampleBuffer, staleness: StalenessManager, settings: SchedulerSettings,
                 decode: Callable[[list[int]], str], poll_s: float = 0.005, teacher: Any = None) -> None:
        self.dataset, self.proxy, self.reward_pool = dataset, proxy, reward_pool
        self.teacher = teacher  # rollout/teacher.TeacherScorer with distill.teacher: scores each finished response
        self.group_filter, self.buffer, self.staleness = group_filter, buffer, staleness
        self.settings, self.decode, self.poll_s = settings, decode, poll_s
        self.stats = RolloutStats()
        self._requeued: Deque[Any] = collections.deque()
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False
        self._next_group_id = 0
        self._refused: dict[Any, tuple[int, str]] = {}  # prompt index → (its length, why it is skipped)
        self._failures: dict[Any, int] = {}  # prompt index → its groups' engine failures in a row
        self._last_success = time.monotonic()
        self._failing_since: Optional[float] = None
        self._last_error: Optional[BaseException] = None
        self._fatal: Optional[BaseException] = None
        # Sent only when on: a proxy (or a test's) without routes support keeps working without it.
        self._route_kw = {"return_routed_experts": True} if settings.return_routed_experts else {}
        self._wake: Optional[asyncio.Event] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.on_group: Optional[Callable[[Group], None]] = None  # e.g. a GroupDump, before the buffer
        self.group_runner: Optional[GroupRunner] = None  # set by the runtime (e.g. agentic episodes)
        self._inflight: dict[int, Any] = {}  # group id → its prompt, while the group is generating
        self._group_tasks: dict[int, tuple[int, asyncio.Task]] = {}  # group id → (start version, task)
        self._expired: set[int] = set()  # groups cancelled because a push made them untrainable
        self._seen_version = staleness.version

    # ------------------------------------------------------------------ called from other threads
    def requeue_prompt(self, group: Group, prompt: Any = None) -> None:
        """Thread-safe: put a stale group's prompt back at the front of the queue."""
        item = prompt if prompt is not None else group.prompt
        if item is None:
            return
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._requeued.appendleft, item)
        else:
            self._requeued.appendleft(item)

    def stop(self) -> None:
        """Thread-safe: stop admitting; the run loop aborts what is in flight and returns."""
        self._stopping = True
        loop = self._loop
        if loop is None or self._wake is None or loop.is_closed():
            return  # not started, or the loop already ended (an error stops it): nothing to wake
        try:
            loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the loop closed between the check and the call
            pass

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        """Admit groups while capacity allows until stop(); closes the buffer on exit (with the
        error, if one ended the loop)."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        n = self.settings.n_samples_per_prompt
        error: Optional[BaseException] = None
        try:
            while not self._stopping:
                self._check_down(time.monotonic())
                if self._fatal is not None:
                    raise self._fatal
                if self.staleness.version != self._seen_version:
                    self._seen_version = self.staleness.version
                    self._expire_in_flight(self._seen_version)
                version = self.staleness.try_admit(n)
                if version is None:
                    self._wake.clear()
                    try:  # capacity frees on consume (other thread) or drop: poll briefly
                        await asyncio.wait_for(self._wake.wait(), timeout=self.poll_s)
                    except asyncio.TimeoutError:
                        pass
                    continue
                prompt = self._next_prompt()
                group_id = self._next_group_id
                self._next_group_id += 1
                self._inflight[group_id] = prompt
                task = asyncio.create_task(self._run_group(prompt, group_id, version))
                self._tasks.add(task)
                self._group_tasks[group_id] = (version, task)
                task.add_done_callback(self._tasks.discard)
        except BaseException as e:  # noqa: BLE001 - reported through the buffer to the trainer
            error = e
        finally:
            self._stopping = True
            await self._drain()
            self.buffer.close(error)
        if error is not None and not isinstance(error, asyncio.CancelledError):
            raise error

    async def _drain(self) -> None:
        if not self._tasks:
            return
        timeout = DRAIN_TIMEOUT_S
        try:
            await self.proxy.abort_all()
        except Exception as e:  # engines gone or unreachable: nothing aborted will come back
            logger.warning("abort_all at rollout stop failed: %s", e)
            timeout = DRAIN_AFTER_FAILED_ABORT_S
        done, pending = await asyncio.wait(list(self._tasks), timeout=timeout)
        for t in pending:
            t.cancel()

    # ------------------------------------------------------------------ one group
    async def _run_group(self, prompt: Any, group_id: int, version: int) -> None:
        try:
            await self._run_group_inner(prompt, group_id, version)
        finally:
            self._inflight.pop(group_id, None)
            self._group_tasks.pop(group_id, None)
            self._expired.discard(group_id)
            self.buffer.landed(version, self.settings.n_samples_per_prompt)

    def _expire_in_flight(self, version: int) -> int:
        """Cancel the groups in flight that no step from `version` on may train (start < version − α).
        Only redundant prompts leave such groups behind (the trainer waits for them otherwise).
        Returns the number of groups cancelled."""
        cutoff = version - self.staleness.alpha
        doomed = [(gid, task) for gid, (v, task) in self._group_tasks.items()
                  if v < cutoff and gid not in self._expired and not task.done()]
        for gid, task in doomed:
            self._expired.add(gid)
            task.cancel()
        if doomed:
            logger.debug("version %d: cancelled %d surplus groups started before %d", version, len(doomed), cutoff)
        return len(doomed)

    def _drop_expired(self, prompt: Any, n: int) -> None:
        if self.buffer.stale_policy == "regenerate":
            self._requeued.appendleft(prompt)
            self.staleness.on_drop(n, reason="regenerated")
        else:
            self.staleness.on_drop(n, reason="stale")
        self.stats.groups_expired += 1

    # ------------------------------------------------------------------ checkpoint (loop thread)
    def snapshot(self) -> dict[str, Any]:
        """What a resume needs to lose and duplicate no prompt: the dataset position and every prompt
        taken from it but not yet in the buffer (in flight, or re-queued), oldest first. Call on the
        loop thread (RolloutRuntime.snapshot does)."""
        pending = [self._inflight[g] for g in sorted(self._inflight)] + list(self._requeued)
        return {"dataset": self.dataset.state_dict(), "pending_prompts": pending,
                "next_group_id": self._next_group_id}

    def restore(self, state: dict[str, Any]) -> None:
        """Before run(): continue from a snapshot (pending prompts are generated again first)."""
        self.dataset.load_state_dict(state["dataset"])
        self._requeued = collections.deque(state["pending_prompts"])
        self._next_group_id = int(state["next_group_id"])

    async def _run_group_inner(self, prompt: Any, group_id: int, version: int) -> None:
        n = self.settings.n_samples_per_prompt
        t0 = time.monotonic()
        try:
            if self.group_runner is not None:  # multi-turn episodes; rewards come from the env
                samples = await self.group_runner.run_group(group_id=group_id, prompt=prompt, version=version,
                                                            group_size=n)
            elif n == 1 or (self.settings.prompt_replication and self.settings.replication_chunk <= 1):
                samples = await asyncio.gather(*[self._run_sample(prompt, group_id, i, version) for i in range(n)])
            elif self.settings.prompt_replication:  # chunks of `replication_chunk` samples, spread
                k = self.settings.replication_chunk
                parts = await asyncio.gather(*[self._run_parallel(prompt, group_id, version, first=i, count=min(k, n - i))
                                               for i in range(0, n, k)])
                samples = [s for part in parts for s in part]
            else:
                samples = await self._run_parallel(prompt, group_id, version)
        except asyncio.CancelledError:
            if group_id in self._expired and not self._stopping:
                self._drop_expired(prompt, n)
                return  # we cancelled it ourselves: the task ends normally
            self.staleness.on_drop(n, reason="cancelled")
            raise
        except Exception as e:  # engine failure after the proxy's retries: re-queue the prompt
            if isinstance(e, GroupDropped):  # its samples could not finish (counted there): no retry
                self.staleness.on_drop(n, reason="error")
                return
            refusal = deterministic_refusal(e)
            if refusal is not None and not self._stopping:  # asking again gets the same answer
                self._skip(prompt, n, f"the engine refused it: {refusal}")
                return
            self.stats.engine_errors += 1
            if self._stopping:
                self.staleness.on_drop(n, reason="cancelled")
                return
            index = getattr(prompt, "index", "?")
            failures = self._failures[index] = self._failures.get(index, 0) + 1
            self._note_failure(e)
            if failures > self.settings.max_prompt_retries:  # it keeps failing: a bad prompt, not a bad engine
                self._failures.pop(index)
                self.stats.skipped_after_retries += 1
                self._skip(prompt, n, f"its group failed {failures} times on the engines "
                                      f"(rollout.max_prompt_retries={self.settings.max_prompt_retries}); last error: {e}")
                return
            self.staleness.on_drop(n, reason="error")
            logger.warning("group %d (prompt %s) failed (%d of %d tries): %s; prompt re-queued", group_id,
                           index, failures, self.settings.max_prompt_retries + 1, e)
            self._requeued.appendleft(prompt)
            return
        if self._stopping or any(s is None for s in samples):
            self.staleness.on_drop(n, reason="cancelled")
            return
        self._last_success = time.monotonic()
        self._failing_since = None
        self._failures.pop(getattr(prompt, "index", "?"), None)
        overflow = overflowing_rewards(samples, group_id=group_id, prompt_index=getattr(prompt, "index", "?"))
        self.stats.reward_overflow += len(overflow)
        if overflow or any(s.reward_failed for s in samples):
            self.staleness.on_drop(n, reason="failed")
            return
        group = Group(group_id=group_id, prompt_index=getattr(prompt, "index", -1), samples=list(samples),
                      version_start=min(s.version_start for s in samples), time_submitted=t0,
                      time_finished=time.monotonic(), prompt=prompt)
        self.stats.groups_finished += 1
        self.stats.group_latency_s += group.time_finished - t0
        if not self.group_filter(group.rewards):
            self.stats.groups_filtered += 1
            self.staleness.on_drop(n, reason="filtered", lengths=[len(s.response_ids) for s in samples])
            return
        if self.on_group is not None:
            self.on_group(group)
        self.buffer.put(group)

    def _next_prompt(self) -> Any:
        if self._requeued:
            return self._requeued.popleft()
        for _ in range(max(1, self._dataset_size())):
            prompt = self.dataset.next_prompt()
            if getattr(prompt, "index", None) not in self._refused:
                return prompt
        raise self._all_refused()

    def _dataset_size(self) -> int:
        """Prompts per epoch; an endless source (no len) never runs out of prompts to try."""
        try:
            return len(self.dataset)
        except TypeError:
            return 1 << 62

    def _skip(self, prompt: Any, n: int, why: str) -> None:
        index = getattr(prompt, "index", "?")
        self.stats.skipped_prompts += 1
        self.staleness.on_drop(n, reason="skipped")
        self._refused[index] = (len(getattr(prompt, "prompt_ids", ())), why)
        logger.warning("prompt %s (%d tokens) skipped: %s", index, self._refused[index][0], why)
        if len(self._refused) >= self._dataset_size() and self._fatal is None:
            self._fatal = self._all_refused()

    def _all_refused(self) -> RolloutError:
        index, (length, why) = next(iter(self._refused.items()))
        return RolloutError(f"every prompt of the dataset ({self._dataset_size()}) was refused by the engines or kept "
                            f"failing on them, so no step can be filled; e.g. prompt {index} ({length} tokens): {why}")

    def _note_failure(self, error: BaseException) -> None:
        self._failing_since = self._failing_since or time.monotonic()
        self._last_error = error
        self._check_down(time.monotonic())

    def _check_down(self, now: float) -> None:
        """Also on the admission loop's tick: retries may wait for a healthy engine without failing again."""
        since = None if self._failing_since is None else max(self._failing_since, self._last_success)
        if self._fatal is None and since is not None and now - since > self.settings.engine_down_deadline_s:
            self._fatal = RolloutError(f"no rollout request succeeded for {self.settings.engine_down_deadline_s:.0f} s "
                                       f"(engines down?); last error: {self._last_error}")
        short = getattr(self.proxy, "fleet_short", lambda *_: None)(now, self.settings.engine_down_deadline_s)
        self._fatal = self._fatal or (RolloutError(short) if short else None)  # below engines.min_engines too long

    def _params(self, remaining: int) -> dict[str, Any]:
        params = {**self.settings.sampling_params, "max_new_tokens": remaining}
        if "min_new_tokens" in params:  # a resumed response counts the tokens it already has
            done = self.settings.max_new_tokens - remaining
            params["min_new_tokens"] = max(0, min(params["min_new_tokens"] - done, remaining))
        return params

    async def _run_sample(self, prompt: Any, group_id: int, index: int, version: int) -> Optional[Sample]:
        """One response, resumed from its prefix when a push aborts it; rewarded the moment it ends."""
        out = await self._generate_from(prompt, f"g{group_id}-s{index}", [], [], [], resumes=0)
        return None if out is None else await self._finish(prompt, group_id, version, *out)

    def _routes(self, result: Any) -> Any:
        """The reply's routes when the run asked for them; a finished reply without them is a
        configuration error (an engine that cannot return routes), never retried."""
        if not self.settings.return_routed_experts or result.aborted:
            return None
        if result.routed_experts is None:
            self._fatal = RolloutError(
                f"trainer.moe_routing_replay=rollout needs the engines' routed experts, but engine "
                f"{result.engine_url or '?'} answered request {result.rid} without meta_info.routed_experts "
                "(asked with return_routed_experts=true): serve a MoE model, and start SGLang with "
                "--enable-return-routed-experts")
            raise self._fatal
        return result.routed_experts

    async def _generate_from(self, prompt: Any, base_rid: str, ids: list[int], logprobs: list[float],
                             versions: list[Optional[int]], *, resumes: int):
        """Generate (or continue) one response after `ids`; resubmit prompt + prefix after aborts.
        Returns (ids, logprobs, versions, finish_reason, resumes, routes), or None when the run is
        stopping. Routes come from the last request, which saw prompt + every token as its input."""
        while True:
            remaining = self.settings.max_new_tokens - len(ids)
            if remaining <= 0:
                if self.settings.return_routed_experts:  # a prefix that used the whole budget: score it for its routes
                    result = await self.proxy.generate(list(prompt.prompt_ids) + ids[:-1], self._params(1),
                                                       rid=f"{base_rid}-routes", **self._route_kw)
                    routes = self._routes(result)
                    return ids, logprobs, versions, "length", resumes, routes[: len(prompt.prompt_ids) + len(ids) - 1]
                return ids, logprobs, versions, "length", resumes, None
            if resumes:
                self.stats.resumes += 1
                if resumes > self.settings.max_resumes:
                    raise RolloutError(f"request {base_rid} was aborted {resumes} times without finishing")
            seg_version = self.staleness.version
            tag_requests(prompt=getattr(prompt, "index", -1), version_start=seg_version, resume=resumes)
            result = await self.proxy.generate(list(prompt.prompt_ids) + ids, self._params(remaining),
                                               rid=f"{base_rid}-r{resumes}", **self._route_kw)
            self.stats.requests += 1
            self.stats.tokens_generated += len(result.output_ids)
            ids = ids + list(result.output_ids)
            logprobs = logprobs + list(result.output_logprobs or [])
            versions = versions + _token_versions(result, seg_version)
            if not result.aborted:
                return ids, logprobs, versions, result.finish_reason, resumes, self._routes(result)
            if self._stopping:
                return None
            resumes += 1

    async def _run_parallel(self, prompt: Any, group_id: int, version: int, *, first: int = 0,
                            count: Optional[int] = None) -> list[Optional[Sample]]:
        """One request asks for `count` samples (default: the whole group, i.e. replication off; a
        chunk with replication_chunk > 1), served by one engine. Samples are numbered from `first`."""
        n = self.settings.n_samples_per_prompt if count is None else count
        seg_version = self.staleness.version
        rid = f"g{group_id}" if count is None else f"g{group_id}-c{first}"
        tag_requests(prompt=getattr(prompt, "index", -1), version_start=seg_version)
        results = await self.proxy.generate_n(list(prompt.prompt_ids), self._params(self.settings.max_new_tokens),
                                              n, rid=rid, **self._route_kw)
        self.stats.requests += 1
        self.stats.tokens_generated += sum(len(r.output_ids) for r in results)

        async def one(i: int, r: Any) -> Optional[Sample]:
            ids, lps, vs = list(r.output_ids), list(r.output_logprobs or []), _token_versions(r, seg_version)
            if not r.aborted:
                return await self._finish(prompt, group_id, version, ids, lps, vs, r.finish_reason, 0, self._routes(r))
            if self._stopping:
                return None
            # A push with pause mode abort: this sample goes on alone from its prefix.
            out = await self._generate_from(prompt, f"g{group_id}-s{first + i}", ids, lps, vs, resumes=1)
            return None if out is None else await self._finish(prompt, group_id, version, *out)

        return list(await asyncio.gather(*[one(i, r) for i, r in enumerate(results)]))

    async def _finish(self, prompt: Any, group_id: int, version: int, ids: list[int], logprobs: list[float],
                      versions: list[Optional[int]], finish: str, resumes: int, routes: Any = None) -> Sample:
        finished = finish == "stop"
        scoring = self.reward_pool.score(self.decode(ids), prompt.answer, finished=finished,
                                         prompt=prompt.text, meta=getattr(prompt, "meta", None))
        teacher = top_ids = top_lps = None
        if self.teacher is None:
            outcome = await scoring
        else:  # the teacher's logprobs of these exact tokens (and its top-k), beside the reward
            outcome, (teacher, top_ids, top_lps) = await asyncio.gather(scoring, self.teacher.score(
                prompt.prompt_ids, ids, rid=f"teacher-g{group_id}-{uuid.uuid4().hex[:8]}"))
        self.stats.reward_timeouts += outcome.timed_out
        self.stats.reward_errors += outcome.failed and not outcome.timed_out
        known = [v for v in versions if v is not None]
        token_versions = ([-1 if v is None else v for v in versions]
                          if len(known) < len(versions) or len(set(known)) > 1 else None)
        s = self.settings
        penalty = overlong_penalty(len(ids), max_new_tokens=s.max_new_tokens, buffer_len=s.overlong_buffer_len,
                                   penalty=s.overlong_penalty)
        if penalty > 0:
            self.stats.overlong_penalized += 1
            self.stats.overlong_penalty_sum += penalty
        return Sample(prompt_ids=list(prompt.prompt_ids), response_ids=ids, behavior_logprobs=logprobs,
                      reward=float(outcome.reward) - penalty, group_id=group_id, finished=finished, version_start=version,
                      version_end=max(known) if known else self.staleness.version, token_versions=token_versions,
                      prompt_index=getattr(prompt, "index", -1), finish_reason=finish,
                      reward_failed=bool(outcome.failed), num_resumes=resumes, routed_experts=routes,
                      teacher_logprobs=teacher, teacher_topk_ids=top_ids, teacher_topk_logprobs=top_lps)


def _token_versions(result: Any, seg_version: int) -> list[Optional[int]]:
    """Per-token policy versions of one reply: the engine's spans when it reports them; a single
    version when the segment provably saw one (the engine's version equals the one at submission);
    None (unknown) for tokens of a segment that spanned a push without spans."""
    spans = result.span_versions()
    if spans is not None:
        return spans
    end = version_number(result.weight_version)
    n = len(result.output_ids)
    if end is None or end == seg_version:
        return [seg_version] * n
    return [None] * n
