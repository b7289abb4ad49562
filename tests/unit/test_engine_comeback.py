"""A push that finds no engine in service waits for one that is coming back (found by the soak, issue 37:
one killed engine of the single-engine quickstart ended the run with WeightSyncError at the next push,
though the launcher had it healthy again seconds later). Fakes stand in for the bridge and the engines;
tests/e2e/test_soak.py kills the real engine twice.

Also the soak's fault-injection hook that cuts one weight sync (weight_sync/fault_injection.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest

from megatron_flash.controller.engine_handoff import EngineHandoff
from megatron_flash.engines.launcher import EngineLauncher
from megatron_flash.rollout.runtime import RolloutRuntime
from megatron_flash.weight_sync.fault_injection import ENV, sync_cut_hook
from megatron_flash.weight_sync.report import SyncReport, WeightSyncError

URL = "http://127.0.0.1:1"


class Bridge:
    """Fails `failures` syncs as the real bridge does when its only engine is unreachable."""

    def __init__(self, failures: int, *, fail_fast: bool = False) -> None:
        self.failures, self.fail_fast, self.memory = failures, fail_fast, None
        self.urls, self.failed, self.readmitted, self.syncs = [URL], {}, [], 0
        self.synced_to: list[Any] = []

    def sync(self, version: int, *, only: Any = None, trial: Any = ()) -> SyncReport:
        assert not trial  # no engine joins here (engines.join_port off)
        self.syncs += 1
        self.synced_to.append((version, only))
        if self.syncs <= self.failures:
            self.urls, self.failed = [], {URL: "pause_generation: EngineUnreachable"}
            raise WeightSyncError(f"weight sync to version {version}: engine(s) taken out of service",
                                  report=SyncReport(version, 0.0, 0, 0, "ipc", failed_urls=[URL]))
        return SyncReport(version, 0.1, 10, 1, "ipc", synced_urls=list(self.urls))

    def readmit(self, urls: list[str]) -> None:
        self.readmitted.append(list(urls))
        self.failed = {}
        self.urls = list(urls)


class Runtime:
    def __init__(self, comes_back: bool, restarted: tuple = ([], [])) -> None:
        self.comes_back, self.waits, self.restarted, self.spawns = comes_back, 0, restarted, False
        self.engines_cfg = SimpleNamespace(down_timeout_s=5.0)
        self.noted: list[Any] = []

    def take_restarted(self) -> tuple[list[str], list[float]]:
        out, self.restarted = self.restarted, ([], [])
        return out

    def wait_restarted(self, *, timeout_s: float) -> tuple[list[str], list[float]]:
        self.waits += 1
        return ([URL], [3.5]) if self.comes_back else ([], [])

    def note_sync(self, version: int, failed: dict, joined: tuple = ()) -> None:
        assert not joined  # no engine joins here (engines.join_port off)
        self.noted.append((version, failed))


def handoff(bridge: Bridge, runtime: Runtime) -> EngineHandoff:
    return EngineHandoff(bridge, runtime, rank=0, broadcast=lambda obj: obj)  # type: ignore[arg-type]


def test_push_waits_for_the_restarted_engine_and_pushes_to_it() -> None:
    bridge, runtime = Bridge(failures=1), Runtime(comes_back=True)
    out = handoff(bridge, runtime).push(7)
    assert bridge.syncs == 2 and bridge.readmitted == [[URL]] and runtime.waits == 1
    assert out["engines_restarted"] == 1 and out["engine_restart_s"] == 3.5  # counted like any restart
    assert out["engines_out_of_service"] == 0 and runtime.noted == [(7, {})]


@pytest.mark.parametrize("comes_back,fail_fast", [(False, False), (True, True)])
def test_push_still_raises_when_nothing_comes_back_or_fail_fast(comes_back: bool, fail_fast: bool) -> None:
    bridge, runtime = Bridge(failures=1, fail_fast=fail_fast), Runtime(comes_back=comes_back)
    with pytest.raises(WeightSyncError, match="taken out of service"):
        handoff(bridge, runtime).push(7)
    assert bridge.syncs == 1 and runtime.waits == (0 if fail_fast else 1)


def runtime_with(launcher: Any, backend: str = "local") -> RolloutRuntime:
    rt = RolloutRuntime.__new__(RolloutRuntime)  # only the launcher and the engine settings are used
    rt.launcher = launcher
    rt.engines_cfg = SimpleNamespace(backend=backend, attach_probe_interval_s=0.1, attach_probe_failures=2)
    return rt


def test_wait_restarted_gives_up_soon_when_no_engine_is_coming_back() -> None:
    launcher = SimpleNamespace(coming_back=lambda: False, take_restarted=lambda: [], restarts=[])
    t0 = time.monotonic()
    assert runtime_with(launcher).wait_restarted(timeout_s=30) == ([], [])
    assert time.monotonic() - t0 < 4  # the 2 s a dying engine may take to be seen as exited, not 30


def test_wait_restarted_waits_for_an_engine_seen_dead_only_after_the_push_failed() -> None:
    """The soak's race: the killed engine's sockets closed (the probe failed) while its process was
    still exiting, so the launcher saw nothing down for a moment."""
    t0 = time.monotonic()
    launcher = SimpleNamespace(coming_back=lambda: 0.5 < time.monotonic() - t0 < 1.5,
                               take_restarted=lambda: [URL] if time.monotonic() - t0 >= 1.5 else [],
                               restarts=[{"ok": True, "url": URL, "restart_s": 1.0}])
    assert runtime_with(launcher).wait_restarted(timeout_s=30) == ([URL], [1.0])


def test_wait_restarted_returns_the_engine_once_it_is_healthy() -> None:
    t0 = time.monotonic()
    back = lambda: time.monotonic() - t0 > 0.3  # noqa: E731
    launcher = SimpleNamespace(coming_back=lambda: not back(), take_restarted=lambda: [URL] if back() else [],
                               restarts=[{"ok": True, "url": URL, "restart_s": 0.3}])
    assert runtime_with(launcher).wait_restarted(timeout_s=30) == ([URL], [0.3])


def test_launcher_coming_back_means_dead_with_restarts_left() -> None:
    launcher = EngineLauncher(backend="local", model_path="/nonexistent", run_dir="/tmp")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    launcher._procs = [dead]
    assert not launcher.coming_back()  # nothing supervises it: it stays dead
    launcher._supervisor = SimpleNamespace()  # supervised (restarts left)
    assert launcher.coming_back()
    launcher.gave_up.append(0)  # its restarts spent
    assert not launcher.coming_back()


def test_sync_cut_hook_cuts_one_sync_per_trigger_file(tmp_path, monkeypatch) -> None:
    calls: list[tuple[str, list[str]]] = []
    bridge = SimpleNamespace(rank0=True, urls=[URL, "http://b"],
                             calls=SimpleNamespace(fan=lambda step, urls, call, **kw: (calls.append((step, urls)), ({}, {}))[1]))
    monkeypatch.delenv(ENV, raising=False)
    assert sync_cut_hook(bridge) is None  # a normal run installs nothing
    trigger = tmp_path / "cut"
    monkeypatch.setenv(ENV, str(trigger))
    assert sync_cut_hook(SimpleNamespace(**{**vars(bridge), "rank0": False})) is None
    hook = sync_cut_hook(bridge)
    hook(0)
    assert calls == []  # no trigger file: nothing happens
    trigger.touch()
    hook(0)
    hook(1)
    assert calls == [("fault injection", [URL])] and not trigger.exists()  # one cut, the first engine


def test_the_only_engine_restarted_while_the_trainer_waits_gets_the_current_version_at_once() -> None:
    """The soak's deadlock: the only engine killed while the trainer waited for a batch came back with the
    checkpoint's weights; the proxy would not route to it before a push, and no push comes before a batch."""
    bridge, runtime = Bridge(failures=0), Runtime(comes_back=False, restarted=([URL], [2.0]))
    h = handoff(bridge, runtime)
    assert h.wake() == h.restarted_while_waiting
    assert h.restarted_while_waiting()
    h.rejoin(5)
    assert bridge.synced_to == [(5, [URL])] and bridge.readmitted == [[URL]] and runtime.noted == [(5, {})]
    out = h.push(6)  # the step's row counts the restart
    assert out["engines_restarted"] == 1 and out["engine_restart_s"] == 2.0 and bridge.synced_to[-1] == (6, None)


def test_with_another_engine_serving_the_restarted_one_waits_for_the_next_push() -> None:
    bridge, runtime = Bridge(failures=0), Runtime(comes_back=False, restarted=([URL], [2.0]))
    bridge.urls = [URL, "http://b"]
    h = handoff(bridge, runtime)
    assert not h.restarted_while_waiting()  # the batch comes from engine b
    out = h.push(6)
    assert bridge.readmitted == [[URL]] and out["engines_restarted"] == 1 and bridge.synced_to == [(6, None)]


def test_the_batch_wait_returns_none_when_woken() -> None:
    from megatron_flash.buffer.sample_buffer import SampleBuffer
    from megatron_flash.buffer.staleness import StalenessManager

    buffer = SampleBuffer(StalenessManager(alpha=1, batch_size=4))
    t0 = time.monotonic()
    assert buffer.take_batch(4, timeout_s=30, poll_s=0.05, wake=lambda: time.monotonic() - t0 > 0.2) is None
    with pytest.raises(TimeoutError):
        buffer.take_batch(4, timeout_s=0.2, poll_s=0.05, wake=lambda: False)
