"""The rollout loop in a process of its own (`rollout.runner=process`).

In thread mode the scheduler, the engine proxy, reply parsing, rewards and buffer admission run as an
asyncio thread of trainer rank 0: they share its GIL and slow training down (docs/benchmarks.md). Here
a spawned process holds all of them — its own StalenessManager, SampleBuffer and RolloutRuntime in
thread mode, made there by the `build` function the spawner passes (`runtime.build_in_child`, so this
module never imports the runtime that imports it) — and the trainer keeps only stubs that forward the
few calls it makes:

    trainer rank 0                                  rollout process
    buffer.take_batch(n, timeout_s)   ── pipe ──►   SampleBuffer.take_batch → whole groups back
    staleness.set_version / snapshot / take_drop_lengths
    runtime.snapshot / evaluate / note_sync / take_metrics / stop
    runtime.engine_down (launcher's supervisor) ─ event pipe ─► proxy.take_out

The engines (launcher, restarts) stay with the trainer. Calls go one at a time (a lock); only the
supervisor's engine-down notes use the second, one-way pipe, so they never wait behind a take_batch.
The process ignores SIGTERM/SIGINT (a pre-empted job signals every process; the trainer must still be
able to take a checkpoint snapshot) and gets SIGKILL when the trainer dies (PR_SET_PDEATHSIG). If it
dies, the next call raises: `BufferClosed` for take_batch (the trainer stops and saves), RuntimeError
otherwise, naming the process and its exit code.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import threading
from typing import Any, Callable, Optional

from megatron_flash.buffer.sample_buffer import BufferClosed

logger = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 300.0
"""Spawning the process, importing torch and transformers there and starting the loop."""


def _picklable(error: Optional[BaseException]) -> Optional[BaseException]:
    if error is None:
        return None
    try:
        pickle.dumps(error)
        return error
    except Exception:  # noqa: BLE001 - any unpicklable error becomes its text
        return RuntimeError(f"{type(error).__name__}: {error}")


class _Stub:
    """`target.method(...)` in the rollout process, for the methods listed."""

    def __init__(self, remote: "RolloutProcess", target: str, methods: tuple[str, ...]) -> None:
        self._remote, self._target, self._methods = remote, target, methods

    def __getattr__(self, name: str) -> Any:
        if name not in self._methods:
            raise AttributeError(f"{self._target}.{name} is not available across the rollout process")
        return lambda *args, **kwargs: self._remote.call(self._target, name, *args, **kwargs)


Build = Callable[[dict[str, Any]], dict[str, Any]]
"""In the process: `spec` → the call targets by name ("runtime", "buffer", "staleness"), the loop started.
It crosses to the spawned process by pickling, so it must be a module-level function."""


class RolloutProcess:
    """Starts the process, which runs `build(spec)` (see `child_main`), and waits until its loop runs."""

    def __init__(self, spec: dict[str, Any], build: Build) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        events_in, self._events = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=child_main, args=(child_conn, events_in, spec, build), name="mf-rollout")
        self.proc.start()
        child_conn.close()
        events_in.close()
        self._lock = threading.Lock()
        if not self._conn.poll(STARTUP_TIMEOUT_S):
            self.proc.kill()
            raise RuntimeError(f"the rollout process did not start within {STARTUP_TIMEOUT_S:.0f} s")
        self._result(self._recv())
        self.buffer = _Stub(self, "buffer", ("take_batch",))
        self.staleness = _Stub(self, "staleness", ("set_version", "snapshot", "take_drop_lengths"))
        logger.info("rollout loop in process %d", self.proc.pid)

    def died(self) -> str:
        self.proc.join(timeout=5)
        return f"the rollout process (pid {self.proc.pid}) died (exit code {self.proc.exitcode})"

    def _recv(self) -> tuple:
        try:
            return self._conn.recv()
        except (EOFError, OSError) as e:
            raise RuntimeError(self.died()) from e

    @staticmethod
    def _result(reply: tuple) -> Any:
        kind, value, cause = reply
        if kind == "err":
            if cause is not None:
                value.__cause__ = cause
            raise value
        return value

    def call(self, target: str, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            try:
                self._conn.send((target, method, args, kwargs))
                reply = self._recv()
            except (RuntimeError, OSError) as e:  # EOF on the reply, or a broken pipe on the request
                message = self.died()
                if target == "buffer":  # the trainer's batch wait: it stops the run, naming the cause
                    raise BufferClosed(message) from RuntimeError(message)
                raise RuntimeError(message) from e
        return self._result(reply)

    def engine_down(self, url: str, reason: str) -> None:
        try:
            self._events.send((url, reason))
        except OSError:
            pass  # the process is gone: the next call says so

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc.is_alive():
            try:
                self.call("runtime", "stop")
            except RuntimeError as e:
                logger.warning("rollout process stop: %s", e)
        self.proc.join(timeout=timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)
        self._conn.close()
        self._events.close()


# ---------------------------------------------------------------------------------- the process
def child_main(conn: Any, events: Any, spec: dict[str, Any], build: Build) -> None:
    _die_with_parent(spec["parent_pid"])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S")
    try:
        targets = build(spec)
    except BaseException as e:  # noqa: BLE001 - reported to the trainer, which raises it
        conn.send(("err", _picklable(e), _picklable(e.__cause__)))
        return
    runtime = targets["runtime"]
    conn.send(("ok", os.getpid(), None))
    threading.Thread(target=_forward_events, args=(events, runtime), daemon=True, name="engine-events").start()
    while True:
        try:
            target, method, args, kwargs = conn.recv()
        except (EOFError, OSError):  # the trainer is gone
            runtime.stop()
            return
        try:
            value = getattr(targets[target], method)(*args, **kwargs)
            reply = ("ok", value, None)
        except BaseException as e:  # noqa: BLE001 - the trainer gets it
            reply = ("err", _picklable(e), _picklable(e.__cause__))
        conn.send(reply)
        if (target, method) == ("runtime", "stop"):
            return


def _forward_events(events: Any, runtime: Any) -> None:
    while True:
        try:
            url, reason = events.recv()
        except (EOFError, OSError):
            return
        runtime.engine_down(url, reason)


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL when the trainer dies, even by SIGKILL (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the trainer died before the signal was armed
        os._exit(1)
