"""The elastic fleet's pure pieces: the registration endpoint (auth, validation, the member states the
weight hand-off moves), the proxy's join / leave with re-issue over fake engines, engines.min_engines,
and the config refusals. The whole path with real engines and a real run: tests/e2e/test_elastic_fleet.py."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from typing import Any, List

import pytest

from megatron_flash.config.schema import RunConfig
from megatron_flash.rollout.fleet import FleetRegistry
from megatron_flash.rollout.proxy import LLMProxy
from tests.unit.fake_engine import FakeEngine
from tests.unit.test_proxy import run_with_fakes, wait_until

KEY = "k3y"


def call(base: str, method: str, path: str, body: Any = None, key: str = KEY) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def registry(tmp_path):
    left: list = []
    checked: list = []
    reg = FleetRegistry(api_key=KEY, tp_size=2, own_urls=["http://own:1"], address_file=str(tmp_path / "f.json"),
                        probe_interval_s=0.05, probe_failures=2, on_leave=lambda u, why: left.append((u, why)) or 3,
                        check_engine=lambda u: checked.append(u) if "bad" not in u else (_ for _ in ()).throw(
                            RuntimeError("HTTP Error 401: Unauthorized")))
    reg.left, reg.checked = left, checked
    base = reg.start()
    yield reg, base
    reg.stop()


def test_registration_needs_the_runs_key_and_refuses_bad_fields_by_name(registry, tmp_path) -> None:
    reg, base = registry
    assert json.load(open(tmp_path / "f.json"))["url"] == base
    for key in ("", "wrong"):
        status, body = call(base, "POST", "/fleet/join", {"url": "http://w:2", "tp_size": 2}, key=key)
        assert status == 401 and "engines.api_key" in body["error"]
    assert reg.checked == []  # refused before anything reached the engine
    assert call(base, "POST", "/fleet/join", {"url": "w:2", "tp_size": 2})[1]["error"].startswith("url:")
    status, body = call(base, "POST", "/fleet/join", {"url": "http://w:2", "tp_size": 1})
    assert status == 400 and "tp_size" in body["error"] and "engines.tp_size=2" in body["error"]
    status, body = call(base, "POST", "/fleet/join", {"url": "http://bad:2", "tp_size": 2})
    assert status == 400 and "http://bad:2" in body["error"] and "401" in body["error"]
    assert call(base, "GET", "/nowhere")[0] == 404
    assert reg.take_pending() == []  # none of those joined


def test_a_join_is_pending_until_its_push_then_serving_or_refused(registry) -> None:
    reg, base = registry
    for url in ("http://a:1", "http://b:1"):
        assert call(base, "POST", "/fleet/join", {"url": url + "/", "tp_size": 2, "serves": "m"}) == (
            202, {"state": "pending", "url": url})
    assert call(base, "POST", "/fleet/join", {"url": "http://a:1", "tp_size": 2})[1]["state"] == "pending"  # idempotent
    assert reg.take_pending() == ["http://a:1", "http://b:1"]
    assert reg.take_pending() == []
    assert reg.settle(["http://a:1"], {"http://b:1": "post-sync probe: mean 3.2 > 0.05"}) == ["http://a:1"]
    states = {m["url"]: m["state"] for m in call(base, "GET", "/fleet")[1]["members"]}
    assert states == {"http://own:1": "serving", "http://a:1": "serving", "http://b:1": "refused"}
    assert reg.take_gone() == ["http://b:1"]  # the bridge forgets the refused one
    counts = reg.take_counts()
    assert counts["engines_joined"] == 1 and counts["joins_refused"] == 1 and counts["engines_left"] == 0


def test_leave_reissues_through_the_runtime_and_is_counted(registry) -> None:
    reg, base = registry
    call(base, "POST", "/fleet/join", {"url": "http://a:1", "tp_size": 2})
    reg.take_pending()
    reg.settle(["http://a:1"], {})
    assert call(base, "POST", "/fleet/leave", {"url": "http://a:1", "reason": "preempted"}) == (
        200, {"state": "left", "url": "http://a:1", "reissued": 3})
    assert reg.left == [("http://a:1", "left: preempted")]
    assert call(base, "POST", "/fleet/leave", {"url": "http://a:1"})[1]["reissued"] == 0  # once
    assert call(base, "POST", "/fleet/leave", {"url": "http://zz:1"})[0] == 404
    assert call(base, "POST", "/fleet/leave", {"url": "http://own:1"})[1]["state"] == "left"  # the run's own too
    assert reg.take_gone() == ["http://a:1", "http://own:1"]
    counts = reg.take_counts()
    assert counts["engines_left"] == 2 and counts["requests_reissued"] == 6


def test_a_joined_engine_that_stops_answering_is_lost(registry) -> None:
    reg, base = registry
    call(base, "POST", "/fleet/join", {"url": "http://127.0.0.1:9", "tp_size": 2})  # nothing listens there
    reg.take_pending()
    reg.settle(["http://127.0.0.1:9"], {})
    deadline = time.monotonic() + 10
    while not reg.left and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reg.left == [("http://127.0.0.1:9", "lost: 2 failed /health probes in a row")]
    assert {m["url"]: m["state"] for m in reg.snapshot()}["http://127.0.0.1:9"] == "lost"
    assert reg.take_gone() == ["http://127.0.0.1:9"]
    # the run's own engines are the launcher's to watch, not the registry's
    assert {m["url"]: m["state"] for m in reg.snapshot()}["http://own:1"] == "serving"


def test_an_engine_that_leaves_has_its_requests_reissued_and_gets_nothing_new() -> None:
    async def body(fakes: List[FakeEngine], proxy: LLMProxy) -> None:
        tasks = [asyncio.create_task(proxy.generate([300], {"max_new_tokens": 2}, rid=f"r{i}")) for i in range(4)]
        await wait_until(lambda: fakes[0].inflight == 2 and fakes[1].inflight == 2)
        assert proxy.remove_engine(fakes[0].url, "preempted") == 2
        results = await asyncio.gather(*tasks)
        assert sorted(r.rid for r in results) == [f"r{i}" for i in range(4)]
        assert all(r.finish_reason == "length" and r.engine_url == fakes[1].url for r in results)
        assert not fakes[0].completed  # each request answered once, by the engine that stayed
        # the leaving engine was told to stop them (or saw the connection close)
        await wait_until(lambda: len(set(fakes[0].aborted) | set(fakes[0].disconnected)) == 2)
        more = await proxy.generate([1], {"max_new_tokens": 2}, rid="after")
        assert more.engine_url == fakes[1].url
        m = proxy.metrics()
        assert m.reissued == 2 and len(m.engines) == 1 and proxy.urls == [fakes[1].url]
        assert proxy.remove_engine(fakes[0].url, "again") == 0

    run_with_fakes(body, latency_s=0.3)


def test_a_joining_engine_takes_waiting_requests_and_min_engines_holds_the_queue() -> None:
    async def body(fakes: List[FakeEngine], proxy: LLMProxy) -> None:
        extra = FakeEngine(latency_s=0.0)
        url = await extra.start()
        try:
            proxy.set_min_engines(2)
            proxy.take_out(fakes[1].url, "lost")  # one healthy of two: below min_engines, nothing dispatched
            task = asyncio.create_task(proxy.generate([1], {"max_new_tokens": 2}, rid="held"))
            await asyncio.sleep(0.2)
            assert not task.done() and not fakes[0].started
            assert proxy.fleet_short(0.0, 10.0) is None and proxy.fleet_short(5.0, 10.0) is None
            line = proxy.fleet_short(11.0, 10.0)
            assert "engines.min_engines=2" in line and "1 healthy of 2" in line and "lost" in line
            proxy.add_engine(url)  # a join restores the count: the held request goes out
            result = await asyncio.wait_for(task, 5)
            assert result.finish_reason == "length"
            assert proxy.fleet_short(12.0, 10.0) is None and proxy.fleet_size() == (3, 2)
            with pytest.raises(ValueError, match="already"):
                proxy.add_engine(url + "/")
        finally:
            await extra.close()

    run_with_fakes(body, latency_s=0.0, health_check_interval_s=60.0)


@pytest.mark.parametrize("overrides,match", [
    (["engines.join_port=29600"], "engines.join_port needs engines.api_key"),
    (["engines.join_port=29600", "engines.api_key=k", "weight_sync.transport=ipc"], "transport=ipc"),
    (["engines.join_port=29600", "engines.api_key=k", "weight_sync.transport=broadcast", "rollout.runner=process"],
     "rollout.runner=thread"),
    (["engines.min_engines=2"], "engines.min_engines must be <= engines.num_engines=1"),
    (["engines.join_port=70000"], "engines.join_port must be a port"),
    (["engines.join_host=node"], "engines.join_host is only used with engines.join_port > 0"),
    (["engines.join_address_file=/x/fleet.json"], "engines.join_address_file is only used"),
])
def test_fleet_settings_that_cannot_work_are_refused_by_name(overrides, match) -> None:
    from megatron_flash.config.loader import load_config

    with pytest.raises(ValueError, match=match):
        load_config("configs/quickstart_cpu.yaml", overrides)


def test_fleet_settings_load() -> None:
    from megatron_flash.config.loader import load_config

    cfg = load_config("configs/quickstart_cpu.yaml", ["engines.join_port=29600", "engines.api_key=k",
                                                      "weight_sync.transport=broadcast", "engines.join_host=node"])
    assert isinstance(cfg, RunConfig) and cfg.engines.join_port == 29600 and cfg.engines.join_host == "node"
