"""Reward functions by name, and a pool that scores responses off the rollout's asyncio loop.

A reward function scores one finished response::

    fn(response_text: str, answer: str, *, finished: bool, prompt: str = "", meta: dict | None = None) -> float

``finished`` is False when the response was cut at ``rollout.max_new_tokens`` (no end token).
``prompt`` is the source prompt text and ``meta`` the dataset row's other fields. Built-ins:

  exact_match  1.0 iff finished and the text equals the answer (synthetic tasks)
  answer_first_long  1.0 iff the text starts with the answer and is ≥ meta["response_tokens"] characters
               long, finished or not (data.task=sort4_long; a file's rows give response_tokens)
  math         1.0 iff finished and math-verify finds the response's final answer equal to the gold
               one ("\\boxed{1/2}" vs "0.5"); math_verify is imported on first use only

Your own reward, either way:

  * register it by name in a module that is imported before the run starts, and set
    ``rollout.reward=my_reward``::

        from megatron_flash.rewards import register_reward

        @register_reward("my_reward")
        def my_reward(response_text, answer, *, finished, prompt="", meta=None):
            return float(finished and answer in response_text)

  * or set ``rollout.reward="my_package.my_module:my_reward"``: the module is imported wherever
    the reward runs. With ``rollout.reward_workers > 0`` rewards run in *spawned* processes that
    start from a fresh interpreter and look the reward up by name, so a reward registered only in a
    script's ``if __name__ == "__main__":`` block (or in a notebook) does not exist there; the
    ``"module:function"`` form always works.

``RewardPool(name, num_workers=...)`` turns the function into ``await pool.score(...)``, which
never raises for a bad reward: an exception, a non-number or non-finite result, or a timeout gives
``RewardOutcome(reward=0.0, failed=True, error=...)`` and the caller counts the failed sample.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import math
import multiprocessing
import numbers
import os
import queue
import signal
import threading
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Optional, Protocol

from megatron_flash.named import lookup, registrar
from megatron_flash.trace import REQUEST_TAGS, TRACER

logger = logging.getLogger(__name__)


class RewardFn(Protocol):
    def __call__(self, response_text: str, answer: str, *, finished: bool, prompt: str = "",
                 meta: Optional[dict] = None) -> float: ...


_REWARDS: dict[str, RewardFn] = {}


register_reward: Callable[[str], Callable[[RewardFn], RewardFn]] = registrar(_REWARDS, what="reward")
"""Decorator registering a reward function under ``name`` (new, non-empty, without ':')."""


def get_reward(name: str) -> RewardFn:
    """The reward registered as ``name``, or the function named by ``"module:function"``."""
    return lookup(name, _REWARDS, what="reward")


def list_rewards() -> list[str]:
    return sorted(_REWARDS)


# ----------------------------------------------------------------------------------------- built-ins

@register_reward("exact_match")
def exact_match(response_text: str, answer: str, *, finished: bool, prompt: str = "",
                meta: Optional[dict] = None) -> float:
    from megatron_flash.rewards.synthetic import exact_match_reward

    return exact_match_reward(response_text, answer, finished=finished)


@register_reward("answer_first_long")
def answer_first_long(response_text: str, answer: str, *, finished: bool, prompt: str = "",
                      meta: Optional[dict] = None) -> float:
    from megatron_flash.rewards.synthetic import answer_first_long_reward

    length = (meta or {}).get("response_tokens")
    if not isinstance(length, int):
        raise ValueError("reward 'answer_first_long' needs the row field response_tokens (data.task=sort4_long "
                         f"sets it), got {length!r}")
    return answer_first_long_reward(response_text, answer, response_tokens=length)


MATH_TIMEOUT_S = 5
"""math-verify's own limit per parse/comparison, in seconds (main thread only, see math_reward)."""


@register_reward("math")
def math_reward(response_text: str, answer: str, *, finished: bool, prompt: str = "",
                meta: Optional[dict] = None) -> float:
    """1.0 iff the response is finished and math-verify judges its answer equal to ``answer``.

    math-verify bounds parsing and comparison with ``signal.alarm``, which exists only in the main
    thread; elsewhere it raises ValueError. So the limits are on in a main thread (a RewardPool
    worker process runs tasks in its main thread) and off in other threads (an inline pool's own
    thread, for one), where the pool's deadline applies.
    """
    if not finished:
        return 0.0  # a truncated response has no final answer, whatever it contains
    from math_verify import parse, verify

    limit = MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(_as_latex(answer), parsing_timeout=limit)
    if not gold:
        raise ValueError(f"cannot parse the gold answer {answer!r}")
    predicted = parse(response_text, parsing_timeout=limit)
    return 1.0 if verify(gold, predicted, timeout_seconds=limit) else 0.0


def _as_latex(answer: str) -> str:
    # Without math delimiters math-verify reads only a plain expression: "2\sqrt{2}" parses as 2.
    if any(mark in answer for mark in ("$", "\\boxed", "\\(", "\\[")):
        return answer
    return f"${answer}$"


# -------------------------------------------------------------------------------------------- pool

@dataclasses.dataclass
class RewardOutcome:
    reward: float
    failed: bool
    error: str = ""
    timed_out: bool = False
    """The call was still running at the pool's deadline (counted apart from errors: metric reward_timeouts)."""


def _call(fn: RewardFn, name: str, response_text: str, answer: str, finished: bool, prompt: str,
          meta: Optional[dict]) -> RewardOutcome:
    try:
        value: Any = fn(response_text, answer, finished=finished, prompt=prompt, meta=meta)
    except (KeyboardInterrupt, SystemExit, asyncio.CancelledError):
        raise
    except BaseException as e:  # math_verify's TimeoutException, for one, is not an Exception
        return RewardOutcome(0.0, True, f"reward {name!r} raised {type(e).__name__}: {e}")
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        return RewardOutcome(0.0, True, f"reward {name!r} returned {value!r} ({type(value).__name__}); "
                                        "expected a finite number")
    return RewardOutcome(float(value), False)


class _InlineRunner:
    """Runs reward calls one at a time on a daemon thread for asyncio callers, each with a deadline from
    its own start (not from its turn in the queue). Python cannot stop a thread: one whose call is past
    its deadline is retired (it exits once the call returns, if ever; a daemon cannot keep the process
    alive) and a fresh thread takes the calls queued behind it."""

    def __init__(self, fn: RewardFn, name: str) -> None:
        self._fn, self._name = fn, name
        self._calls: "queue.Queue[Any]" = queue.Queue()
        self._retired = self._start()

    def _start(self) -> threading.Event:
        retired = threading.Event()
        threading.Thread(target=self._serve, args=(retired,), name=f"reward-{self._name}", daemon=True).start()
        return retired

    def _serve(self, retired: threading.Event) -> None:
        while not retired.is_set() and (item := self._calls.get()) is not None:
            args, started, done = item
            if not (started.set_running_or_notify_cancel() and done.set_running_or_notify_cancel()):
                continue  # its caller gave up while it queued
            started.set_result(None)
            try:
                outcome = _call(self._fn, self._name, *args)
            except BaseException as e:  # noqa: BLE001 - e.g. SystemExit raised by the reward: fail the sample
                outcome = RewardOutcome(0.0, True, f"reward {self._name!r} raised {type(e).__name__}: {e}")
            done.set_result(outcome)

    async def run(self, args: tuple, *, timeout_s: float) -> Optional[RewardOutcome]:
        """The call's outcome, or None when it was still running timeout_s after it started (its thread is
        then retired and replaced)."""
        started: concurrent.futures.Future = concurrent.futures.Future()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((args, started, done))
        await asyncio.wrap_future(started)  # calls run one at a time: no deadline while earlier ones run
        try:
            return await asyncio.wait_for(asyncio.wrap_future(done), timeout_s)
        except asyncio.TimeoutError:
            self._retired.set()
            self._retired = self._start()
            return None

    def close(self) -> None:
        self._retired.set()
        self._calls.put(None)  # wakes an idle thread, which exits


def _worker_ready(name: str) -> int:
    try:
        get_reward(name)  # import the reward's module now, not inside the first sample's time limit
    except ValueError:
        pass  # keep the process: each sample reports the error (see _worker_score)
    return os.getpid()


def _worker_score(name: str, response_text: str, answer: str, finished: bool, prompt: str,
                  meta: Optional[dict]) -> RewardOutcome:
    try:
        fn = get_reward(name)
    except ValueError as e:
        return RewardOutcome(0.0, True, f"reward {name!r} is not known in the worker process: {e}")
    return _call(fn, name, response_text, answer, finished, prompt, meta)


class _Worker:
    """One spawned process in its own single-process executor, so a hung reward can be killed
    (and the process replaced) without touching the samples other workers are scoring."""

    def __init__(self) -> None:
        self.executor: Optional[concurrent.futures.ProcessPoolExecutor] = None
        self.pid = 0

    def start(self, name: str, *, timeout_s: float) -> None:
        self.executor = concurrent.futures.ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        self.pid = self.executor.submit(_worker_ready, name).result(timeout=timeout_s)

    def stop(self, *, kill: bool) -> None:
        if self.executor is None:
            return
        if kill and self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.executor, self.pid = None, 0


class RewardPool:
    """Scores responses with the reward named ``name`` (see ``get_reward``) for asyncio callers.

    ``num_workers == 0``: the reward runs on one daemon thread of the pool, one call at a time, the
    event loop free meanwhile (fine for cheap rewards such as exact_match). A call still running
    ``timeout_s`` after it started fails its sample; its thread, which Python cannot stop, is
    abandoned (logged, counted in ``num_abandoned``) and a fresh one takes the next calls.
    ``num_workers > 0``: that many spawned processes (see the module docstring on how they find
    user rewards), started in the background at construction; a call that runs past
    ``timeout_s`` is failed and its process killed (a fresh one starts when next needed, outside
    any sample's time limit).

    ``num_scored`` counts finished ``score`` calls (failed ones included), ``num_failed`` the
    failed ones. Call ``close()`` (or use ``with``) to stop the processes.
    """

    STARTUP_TIMEOUT_S = 120.0
    """Limit for spawning a worker and importing its reward (outside the per-sample timeout)."""

    def __init__(self, name: str, *, num_workers: int = 0, timeout_s: float = 30.0) -> None:
        if num_workers < 0:
            raise ValueError(f"RewardPool num_workers must be >= 0, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"RewardPool timeout_s must be > 0, got {timeout_s}")
        self.name = name
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.num_scored = 0
        self.num_failed = 0
        self._fn = get_reward(name)  # unknown names fail here, in the caller
        self._inline = _InlineRunner(self._fn, name) if num_workers == 0 else None
        self.num_abandoned = 0  # inline threads left running past their deadline
        self._lock = threading.Lock()
        self._closed = False
        self._threads: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._idle: "queue.Queue[_Worker]" = queue.Queue()
        self._workers = [_Worker() for _ in range(num_workers)]
        if num_workers:
            # One waiting thread per process: a thread hands a sample to an idle process and
            # waits for it with a deadline, so the asyncio loop never blocks and never polls.
            self._threads = concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix="reward")
            for worker in self._workers:
                self._threads.submit(self._warm_up, worker)

    async def score(self, response_text: str, answer: str, *, finished: bool, prompt: str = "",
                    meta: Optional[dict] = None) -> RewardOutcome:
        """Score one response; never raises for a failing reward (see ``RewardOutcome``)."""
        if self._closed:
            raise RuntimeError(f"RewardPool({self.name!r}) is closed")
        args = (response_text, answer, finished, prompt, meta)
        # On the run's timeline (trace.py), tagged with the prompt whose requests this task sent.
        with TRACER.concurrent("reward", "reward", "rewards", **(REQUEST_TAGS.get() or {})) as info:
            if self._threads is None:
                outcome = await self._score_inline(*args)
            else:
                outcome = await asyncio.wrap_future(self._threads.submit(self._score_in_worker, *args))
            info.update(reward=outcome.reward, failed=bool(outcome.failed))
        with self._lock:
            self.num_scored += 1
            self.num_failed += outcome.failed
        return outcome

    def close(self) -> None:
        """Wait for the samples being scored (at most ``timeout_s``), then stop the processes."""
        if self._closed:
            return
        self._closed = True
        if self._inline is not None:
            self._inline.close()
        if self._threads is not None:
            self._threads.shutdown(wait=True)
        for worker in self._workers:
            worker.stop(kill=False)

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _score_inline(self, *args: Any) -> RewardOutcome:
        outcome = await self._inline.run(args, timeout_s=self.timeout_s)
        if outcome is None:
            self.num_abandoned += 1
            logger.warning("reward %r still running %s s after it started (rollout.reward_timeout_s): sample "
                           "failed, its thread abandoned (%d so far); a reward that may hang belongs in "
                           "rollout.reward_workers > 0, whose processes are killed", self.name, self.timeout_s,
                           self.num_abandoned)
            return RewardOutcome(0.0, True, f"reward {self.name!r} timed out after {self.timeout_s} s "
                                            "(inline thread abandoned)", timed_out=True)
        return outcome

    def _warm_up(self, worker: _Worker) -> None:
        try:
            worker.start(self.name, timeout_s=self.STARTUP_TIMEOUT_S)
        except Exception:
            worker.stop(kill=True)  # retried (and the error reported) when a sample needs it
        finally:
            self._idle.put(worker)

    def _score_in_worker(self, *args: Any) -> RewardOutcome:
        worker = self._idle.get()  # never waits long: one thread per worker
        try:
            if worker.executor is None:
                try:
                    worker.start(self.name, timeout_s=self.STARTUP_TIMEOUT_S)
                except Exception as e:
                    worker.stop(kill=True)
                    return RewardOutcome(0.0, True, f"reward {self.name!r}: worker process failed to "
                                                    f"start: {type(e).__name__}: {e}")
            assert worker.executor is not None
            future = worker.executor.submit(_worker_score, self.name, *args)
            try:
                return future.result(timeout=self.timeout_s)
            except concurrent.futures.TimeoutError:
                worker.stop(kill=True)
                return RewardOutcome(0.0, True, f"reward {self.name!r} timed out after {self.timeout_s} s "
                                                "(worker process killed and replaced)", timed_out=True)
            except BrokenProcessPool as e:
                worker.stop(kill=True)
                return RewardOutcome(0.0, True, f"reward {self.name!r}: worker process died "
                                                f"({type(e).__name__}: {e})")
            except Exception as e:  # e.g. meta that cannot be pickled
                return RewardOutcome(0.0, True, f"reward {self.name!r}: could not run in a worker: "
                                                f"{type(e).__name__}: {e}")
        finally:
            self._idle.put(worker)
