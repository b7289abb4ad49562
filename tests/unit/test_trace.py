"""The run timeline (megatron_flash/trace.py) and the request activity behind pipeline/overlap.

Checked: off records and writes nothing; spans on one thread nest on one row, overlapping ones get
rows of their own (never two open spans on one row, also from many threads); the file is a valid
trace-event JSON object after every step (a crash keeps a readable trace), rotates every N steps with
each file naming its own tracks, and a resumed run never overwrites one; the rollout process's events
keep their clock through drain/add; busy_fraction against hand-computed unions; the proxy's request
span names; the config keys.
"""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import pytest

from megatron_flash.config import ConfigError, load_config
from megatron_flash.rollout.request_trace import RequestWatch
from megatron_flash.trace import ACTIVITY, TRACER, RequestActivity, Tracer, busy_fraction, tag_requests


@pytest.fixture
def tracer():
    t = Tracer()
    yield t
    t.stop()


def load(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)["traceEvents"]


def spans(events: list[dict]) -> list[dict]:
    return [e for e in events if e["ph"] == "X"]


def test_off_records_nothing_and_writes_no_file(tmp_path, tracer) -> None:
    assert not tracer.enabled
    with tracer.span("a", "c", "trainer") as info:
        info["x"] = 1  # the block may still add args: they go nowhere
    with tracer.concurrent("b", "c", "rewards"):
        pass
    assert tracer.begin("r", "c", "engine 0") is None
    tracer.end(None, finish="stop")
    tracer.instant("i", "c", "buffer")
    tracer.step_done(0)
    assert tracer.drain() == [] and os.listdir(tmp_path) == []


def test_nesting_lanes_and_a_valid_file_after_every_step(tmp_path, tracer) -> None:
    tracer.start(str(tmp_path), rotate_steps=100)
    with tracer.span("step 0", "step", "trainer"):
        with tracer.span("optimizer step", "train", "trainer", mini_batch=0):
            time.sleep(0.001)
    a = tracer.begin("request", "engine", "engine 0", rid="a")
    b = tracer.begin("request", "engine", "engine 0", rid="b")  # overlaps a: another row
    tracer.end(a, name="request stop", finish="stop")
    c = tracer.begin("request", "engine", "engine 0", rid="c")  # a's row is free again
    tracer.instant("drop stale", "buffer", "buffer", samples=4)
    tracer.step_done(0)
    events = load(str(tmp_path / "trace.json"))  # readable before the run ends
    x = {e["args"].get("rid", e["name"]): e for e in spans(events)}
    assert x["step 0"]["tid"] == x["optimizer step"]["tid"]
    outer, inner = x["step 0"], x["optimizer step"]
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    assert inner["dur"] >= 1000 and inner["args"] == {"mini_batch": 0}  # µs
    assert x["a"]["name"] == "request stop" and x["a"]["args"]["finish"] == "stop"
    tracer.end(b)
    tracer.end(c)
    tracer.stop()
    events = load(str(tmp_path / "trace.json"))
    x = {e["args"].get("rid", e["name"]): e for e in spans(events)}
    assert x["a"]["tid"] == x["c"]["tid"] != x["b"]["tid"] and x["a"]["pid"] == x["b"]["pid"]
    names = {(e["name"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] != "process_sort_index"}
    assert {("process_name", "engine 0"), ("process_name", "trainer"), ("process_name", "buffer"),
            ("thread_name", "engine 0"), ("thread_name", "engine 0 #1")} <= names
    (drop,) = [e for e in events if e["ph"] == "i"]
    assert drop["name"] == "drop stale" and drop["s"] == "t" and drop["args"] == {"samples": 4}


def test_an_exception_ends_its_span_with_the_error(tmp_path, tracer) -> None:
    tracer.start(str(tmp_path), rotate_steps=1)
    with pytest.raises(RuntimeError):
        with tracer.concurrent("reward", "reward", "rewards"):
            raise RuntimeError("boom")
    tracer.stop()
    (span,) = spans(load(str(tmp_path / "trace.json")))
    assert span["args"]["error"] == "RuntimeError: boom"


def test_rotation_every_n_steps_and_resume_never_overwrites(tmp_path, tracer) -> None:
    tracer.start(str(tmp_path), rotate_steps=2)
    for step in range(5):
        with tracer.span(f"step {step}", "step", "trainer"):
            pass
        tracer.step_done(step)
    tracer.stop()
    assert sorted(os.listdir(tmp_path)) == ["trace.1.json", "trace.2.json", "trace.json"]
    for name, steps in (("trace.json", {"step 0", "step 1"}), ("trace.1.json", {"step 2", "step 3"}),
                        ("trace.2.json", {"step 4"})):
        events = load(str(tmp_path / name))
        assert {e["name"] for e in spans(events)} == steps
        assert any(e["ph"] == "M" and e["args"].get("name") == "trainer" for e in events)  # opens alone
    # a resumed run (a new process: another clock origin) at step 2 writes beside the old file
    again = Tracer()
    again.start(str(tmp_path), rotate_steps=2)
    with again.span("step 2", "step", "trainer"):
        pass
    again.step_done(2)
    again.stop()
    assert {e["name"] for e in spans(load(str(tmp_path / "trace.1-1.json")))} == {"step 2"}
    assert {e["name"] for e in spans(load(str(tmp_path / "trace.1.json")))} == {"step 2", "step 3"}


def test_many_threads_never_share_an_open_row(tmp_path, tracer) -> None:
    tracer.start(str(tmp_path), rotate_steps=10)

    def work(i: int) -> None:
        for j in range(50):
            with tracer.concurrent("reward", "reward", "rewards", i=i, j=j):
                time.sleep(0.0002)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tracer.stop()
    by_row: dict[int, list[tuple[float, float]]] = {}
    x = spans(load(str(tmp_path / "trace.json")))
    assert len(x) == 400
    for e in x:
        by_row.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    assert len(by_row) <= 8
    for row in by_row.values():
        row.sort()
        assert all(end <= nxt + 1e-3 for (_, end), (nxt, _) in zip(row, row[1:]))


def test_forwarded_events_keep_their_clock(tmp_path, tracer) -> None:
    """The rollout process records raw CLOCK_MONOTONIC ns; the writer places them on its own timeline."""
    tracer.start(str(tmp_path), rotate_steps=10)
    child = Tracer()
    child.forward()
    time.sleep(0.01)
    with child.span("env step", "env", "envs"):
        pass
    events = child.drain()
    assert child.drain() == []
    tracer.add(events)
    tracer.stop()
    (span,) = spans(load(str(tmp_path / "trace.json")))
    assert span["name"] == "env step" and span["ts"] >= 10_000  # µs after the writer's origin


def test_busy_fraction_is_the_union_inside_the_window() -> None:
    # window [10, 20]: [8, 12] gives 2, [11, 14] adds 2 (12..14), [16, 17] 1, open since 19 (now 30) 1
    assert busy_fraction([(8, 12), (11, 14), (16, 17), (25, 30)], [19], lo=10, hi=20, now=30) == pytest.approx(0.6)
    assert busy_fraction([(0, 9), (21, 30)], [], lo=10, hi=20, now=30) == 0.0  # alternating: no overlap
    assert busy_fraction([], [5], lo=10, hi=20, now=30) == 1.0
    assert busy_fraction([(0, 100)], [], lo=10, hi=10, now=30) == 0.0


def test_request_activity_hands_each_interval_over_once() -> None:
    activity = RequestActivity(max_intervals=3)
    first, second = activity.begin(), activity.begin()
    activity.end(first)
    done, open_starts, now = activity.take()
    assert len(done) == 1 and done[0][0] <= done[0][1] <= now and len(open_starts) == 1
    activity.end(second)
    assert len(activity.take()[0]) == 1 and activity.take()[0] == []
    for _ in range(5):
        activity.end(activity.begin())
    assert len(activity.take()[0]) == 3  # bounded where nobody takes them


def result(finish: str, *, retractions: int = 0, versions=None, message=None):
    spans_ = None if versions is None else [SimpleNamespace(start=0, end=1, version=v) for v in versions]
    return SimpleNamespace(finish_reason=finish, output_ids=[1, 2], weight_version="3", aborted=finish == "abort",
                           finish_message=message, meta_info={"num_retractions": retractions},
                           span_versions=lambda: versions, weight_version_spans=spans_)


def test_request_spans_say_how_each_request_ended(tmp_path) -> None:
    import asyncio

    TRACER.start(str(tmp_path), rotate_steps=10)
    try:
        for tags, reply, error in (({"resume": 0}, result("stop"), None),
                                   ({"resume": 0}, result("abort", message="paused for a weight update"), None),
                                   ({"resume": 1}, result("length", retractions=2, versions=[3, 4]), None),
                                   ({}, None, ConnectionError("refused")),
                                   ({}, None, asyncio.CancelledError())):
            async def one() -> None:
                tag_requests(prompt=7, version_start=3, **tags)
                watch = RequestWatch("engine 1", "g0-s0", num_samples=1, weight_version="3", queued_ns=0)
                watch.close(reply, error=error)

            asyncio.run(one())
    finally:
        TRACER.stop()
    x = spans(load(str(tmp_path / "trace.json")))
    assert [e["name"] for e in x] == ["request stop", "request abort", "resumed request length retracted",
                                      "request error", "request cancelled"]
    assert all(e["args"]["prompt"] == 7 and e["args"]["version_start"] == 3 for e in x)
    assert x[1]["args"]["abort_message"] == "paused for a weight update"
    assert x[2]["args"]["token_versions"] == "3..4" and x[2]["args"]["retractions"] == 2
    assert x[3]["args"]["error"] == "ConnectionError: refused"
    assert ACTIVITY.take()[1] == []  # every interval closed, with tracing on or off


def test_config_keys(tmp_path) -> None:
    base = ["model.hf_path=/unused"]
    cfg = load_config(None, base + ["logging.trace=true", "logging.trace_rotate_steps=5"])
    assert cfg.logging.trace and cfg.logging.trace_rotate_steps == 5
    with pytest.raises(ConfigError, match="logging.trace_rotate_steps"):
        load_config(None, base + ["logging.trace_rotate_steps=5"])  # without trace it would do nothing
    with pytest.raises(ConfigError, match="logging.trace_rotate_steps"):
        load_config(None, base + ["logging.trace=true", "logging.trace_rotate_steps=0"])


def test_the_tracker_writes_a_trace_only_when_asked(tmp_path) -> None:
    from megatron_flash.config.schema import LoggingConfig
    from megatron_flash.tracking import Tracker

    for trace in (False, True):
        run = tmp_path / str(trace)
        cfg = LoggingConfig(wandb_mode="disabled", tensorboard=False, trace=trace)
        with Tracker(str(run), cfg, total_steps=2) as tracker:
            for step in range(2):
                with TRACER.span(f"step {step}", "step", "trainer"):
                    pass
                tracker.log(step, {"reward_mean": 0.5})
        assert os.path.exists(run / "trace.json") == trace
        assert not TRACER.enabled
    assert {e["name"] for e in spans(load(str(tmp_path / "True" / "trace.json")))} == {"step 0", "step 1"}
