"""The environment contract the env manager drives (never imports Megatron or torch).

An environment holds one episode at a time::

    obs = await env.reset(seed)              # first observation, task instructions included
    while True:
        result = await env.step(action_text) # the model's whole reply for this turn
        if result.done: break
    await env.close()

``Env`` is the asynchronous form the manager awaits; each instance runs in its own coroutine, so a
slow environment delays only its own episode. Most user environments are plain synchronous code:
subclass ``SyncEnv`` and ``make_env`` wraps the instance in ``ThreadedEnv``, which runs every call in a
shared thread pool (``set_env_thread_pool_size``) so a blocking ``step`` never stalls the event loop.

``StepResult.info`` keys the built-ins always set (user envs may set any subset; read with .get):

  success    bool   the episode reached its goal (goal cell, all boxes placed, correct answer)
  invalid    bool   the action text could not be parsed; state unchanged
  truncated  bool   the episode hit the env's own max_steps without success or failure
  tool_error str    (calculator) why a tool call's arguments were rejected; the episode continues

An environment that *fails* (lost connection, crashed simulator) raises ``EnvError``; the manager
counts it and drops the episode instead of stopping the run.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)


class EnvError(RuntimeError):
    """An environment failed (not a bad action: those are ``info["invalid"]``)."""


@dataclasses.dataclass
class StepResult:
    observation: str
    """Text the model sees next (after ``done``, informational only)."""
    reward: float
    """Reward of this step; an episode's return is the sum over its steps."""
    done: bool
    """The episode ended (success, failure, truncation, or an invalid action with end_on_invalid)."""
    info: dict = dataclasses.field(default_factory=dict)
    """Diagnostics, e.g. {"invalid": True}, {"success": True}, {"tool_error": "bad expression"}."""


class Env(abc.ABC):
    """Asynchronous environment: one instance runs one episode at a time."""

    @abc.abstractmethod
    async def reset(self, seed: int) -> str:
        """Start an episode; the same seed gives the same task. Returns the first observation."""

    @abc.abstractmethod
    async def step(self, action_text: str) -> StepResult:
        """Apply the model's reply for this turn."""

    async def close(self) -> None:
        """Release resources; the instance is not used afterwards."""
        return None


class SyncEnv(abc.ABC):
    """Synchronous environment (most user envs); ``make_env`` wraps it in ``ThreadedEnv``.

    Its methods are never called concurrently on one instance, so they need not be thread-safe.
    """

    @abc.abstractmethod
    def reset(self, seed: int) -> str:
        """Start an episode; the same seed gives the same task. Returns the first observation."""

    @abc.abstractmethod
    def step(self, action_text: str) -> StepResult:
        """Apply the model's reply for this turn."""

    def close(self) -> None:
        """Release resources; the instance is not used afterwards."""
        return None


# ------------------------------------------------------------------------------- shared thread pool

DEFAULT_ENV_THREADS = 64
"""Threads shared by all ThreadedEnvs. Env calls mostly wait (I/O, simulated latency), so this is
sized for concurrency, not for cores."""

_pool_lock = threading.Lock()
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_pool_size = DEFAULT_ENV_THREADS


def set_env_thread_pool_size(num_threads: int) -> None:
    """Resize the shared pool. Calls already submitted finish on the old pool; new ones use the new."""
    global _pool, _pool_size
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be an int >= 1, got {num_threads!r}")
    with _pool_lock:
        old, _pool, _pool_size = _pool, None, num_threads
    if old is not None:
        old.shutdown(wait=False)


def env_thread_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The shared pool (created on first use with the size last set)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=_pool_size,
                                                          thread_name_prefix="env")
        return _pool


class _Ticket:
    """One submitted call; the state changes under ThreadedEnv._lock."""
    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = "queued"  # -> "started" (a worker took it) | "dropped" (cancelled before that)


class ThreadedEnv(Env):
    """Runs a ``SyncEnv`` in the shared thread pool through ``loop.run_in_executor``.

    Calls on one instance are serialized in the worker threads. A caller that stops waiting (its
    ``asyncio.wait_for`` timed out) cannot stop a call that already runs in a thread: the call
    finishes in the background and later calls on this instance queue behind it. So after a
    timeout, ``close()`` the env and make a new one. ``close()`` itself never waits for such an
    abandoned call: it marks the env closed (later reset/step raise EnvError) and the wrapped
    ``close()`` runs in the worker thread as soon as the last pending call ends.
    """

    def __init__(self, env: SyncEnv, *,
                 executor: Optional[concurrent.futures.Executor] = None) -> None:
        if not isinstance(env, SyncEnv):
            raise TypeError(f"ThreadedEnv wraps a SyncEnv, got {type(env).__name__}")
        self.env = env
        """The wrapped synchronous environment."""
        self._executor = executor
        self._serial = threading.Lock()  # held while a SyncEnv method runs
        self._lock = threading.Lock()    # guards the counters and flags below
        self._pending = 0                # calls submitted and neither finished nor dropped
        self._closing = False            # close() was called
        self._closed = False             # the wrapped close() was started

    def __repr__(self) -> str:
        return f"ThreadedEnv({self.env!r})"

    async def reset(self, seed: int) -> str:
        return await self._call(self.env.reset, seed)

    async def step(self, action_text: str) -> StepResult:
        return await self._call(self.env.step, action_text)

    async def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            if self._pending:
                return  # the last pending call closes the env when it ends (see _finish)
            self._closed = True
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool(), self._run_close)

    # -- internals ----------------------------------------------------------------------------

    def _pool(self) -> concurrent.futures.Executor:
        return self._executor if self._executor is not None else env_thread_pool()

    async def _call(self, method: Callable[..., Any], arg: Any) -> Any:
        ticket = _Ticket()
        with self._lock:
            if self._closing:
                raise EnvError(f"{method.__name__}() on a closed environment ({self.env!r})")
            self._pending += 1
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool(), self._run, ticket, method, arg)
        except BaseException:  # cancelled, or the pool refused the call
            with self._lock:
                dropped = ticket.state == "queued"
                if dropped:
                    ticket.state = "dropped"  # a worker picking it up later does nothing
            if dropped:
                self._finish(in_worker=False)
            raise

    def _run(self, ticket: _Ticket, method: Callable[..., Any], arg: Any) -> Any:
        with self._lock:
            if ticket.state == "dropped":
                return None
            ticket.state = "started"
        try:
            with self._serial:
                return method(arg)
        finally:
            self._finish(in_worker=True)

    def _finish(self, *, in_worker: bool) -> None:
        with self._lock:
            self._pending -= 1
            close_now = self._closing and not self._closed and self._pending == 0
            if close_now:
                self._closed = True
        if close_now:
            if in_worker:
                self._run_close(quiet=True)
            else:  # on the event loop, which must not block on the wrapped close()
                self._pool().submit(self._run_close, quiet=True)

    def _run_close(self, *, quiet: bool = False) -> None:
        with self._serial:
            try:
                self.env.close()
            except Exception:
                if not quiet:
                    raise
                logger.exception("closing %r after its last call failed", self.env)


def unwrap(env: Any) -> Any:
    """The innermost environment under wrappers that expose ``.env`` (ThreadedEnv, LatencyEnv)."""
    seen = set()
    while hasattr(env, "env") and id(env) not in seen:
        seen.add(id(env))
        env = env.env
    return env
