"""What `logging.trace=true` costs: the CPU quickstart with the timeline off and on, side by side.

    OMP_NUM_THREADS=1 python benchmarks/trace_overhead.py [--steps 14] [--skip 4] [--rounds 2]

Both modes run the product (`launch/pretrain_async_rl.py`, configs/quickstart_cpu.yaml: sort4, the
quickstart's format-only warm model, 16 prompts × 8 samples per step, α = 2) for --steps steps; the
modes alternate off, on, on, off, ... over --rounds pairs so that other load on the machine hits both,
and the first --skip steps of each run (start-up, the pipeline filling) are left out.

On a shared 2-core box the wall time of a step moves with everyone else's load (and so does the CPU
time of a process: its engine's, which tracing never touches, varies as much), so the tracer's cost
is also measured directly, inside the same runs: a sitecustomize on the runs' PYTHONPATH wraps every
entry point of megatron_flash/trace.py and rollout/request_trace.py (span enter/exit, begin/end via
the proxy's RequestWatch, instants, tag_requests, the per-step write) with a thread CPU-time
accumulator. `hooks_ms_per_step` is that time per step: with tracing off it is the hooks' attribute
checks and the always-on request activity, with it on everything tracing does; their difference over
the step time is `direct_pct`. And in this process, where nothing else interferes, the CPU time of
recording and writing one event of a traced run's mix (`cpu_us_per_event`) times the events a traced
step recorded, over the step time: `bound_pct`.

Last line, one JSON object: per mode and round the steady-state s/step, CPU s/step (trainer, engine)
and hooks ms/step, their means, `overhead_pct` (wall, on vs off), `cpu_overhead_pct` (trainer +
engine CPU per step), `direct_pct`, `events_per_step`, `trace_bytes_per_step`, `cpu_us_per_event`,
`bound_pct`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

sys.path.insert(0, benchlib.REPO)
from megatron_flash.trace import Tracer  # noqa: E402


def cpu_us_per_event(num_events: int = 20_000) -> float:
    """Record and write `num_events` events shaped like a traced run's (CPU time, µs per event)."""
    tracer = Tracer()
    with tempfile.TemporaryDirectory() as out:
        tracer.start(out, rotate_steps=1_000_000)
        t0 = time.process_time()
        for i in range(num_events // 4):
            handle = tracer.begin("request", "engine", "engine 0", rid=f"g{i}-s0-r0", prompt=i, version_start=3,
                                  resume=0, weight_version_at_dispatch="3", queued_ms=0.01)
            tracer.end(handle, name="request stop", finish="stop", output_tokens=5, weight_version_at_reply="3")
            with tracer.concurrent("reward", "reward", "rewards", prompt=i, version_start=3) as info:
                info.update(reward=1.0, failed=False)
            tracer.instant("put", "buffer", "buffer", group=i, prompt=i, version_start=3, samples=8)
            with tracer.span("optimizer step", "train", "trainer", epoch=0, mini_batch=0):
                pass
            if i % 500 == 499:
                tracer.step_done(i // 500)
        tracer.stop()
        return (time.process_time() - t0) / num_events * 1e6


HOOKS = r'''
import atexit, json, os, time
import megatron_flash.trace as trace
import megatron_flash.rollout.request_trace as request_trace

_total = [0.0, 0]


def _timed(fn):
    def wrapper(*args, **kwargs):
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _total[0] += time.thread_time() - t0
            _total[1] += 1
    return wrapper


for cls, names in ((trace._Span, ("__enter__", "__exit__")), (trace._LaneSpan, ("__enter__", "__exit__")),
                   (trace.Tracer, ("span", "concurrent", "complete", "instant", "step_done", "add")),
                   (request_trace.RequestWatch, ("__init__", "close"))):
    for name in names:
        setattr(cls, name, _timed(getattr(cls, name)))
trace.tag_requests = _timed(trace.tag_requests)


@atexit.register
def _report():
    if _total[1]:
        with open(os.path.join(os.environ["MF_TRACE_HOOKS_DIR"], f"{os.getpid()}.json"), "w") as f:
            json.dump({"seconds": _total[0], "calls": _total[1]}, f)
'''


def hooks_seconds(hooks_dir: str) -> float:
    total = 0.0
    for name in os.listdir(hooks_dir):
        with open(os.path.join(hooks_dir, name)) as f:
            total += json.load(f)["seconds"]
    return total


def cpu_per_step(mon: "benchlib.CpuMonitor", *, skip: int) -> dict[str, float]:
    """CPU seconds per step of the trainer process and of its engines, after the first `skip` steps."""
    snaps = [s for s in mon.snapshots if s["step"] >= skip - 1]
    a, b = snaps[0], snaps[-1]
    steps = max(b["step"] - a["step"], 1)
    return {name: round((b[key] - a[key]) / steps, 4) for name, key in (("trainer", "proc"), ("engines", "engines"))}


def trace_size(run_dir: str, steps: int) -> tuple[float, float]:
    """(events, bytes) per step of a traced run's files."""
    events = size = 0
    for name in os.listdir(run_dir):
        if name.startswith("trace") and name.endswith(".json"):
            size += os.path.getsize(os.path.join(run_dir, name))
            with open(os.path.join(run_dir, name)) as f:
                events += sum(e["ph"] != "M" for e in json.load(f)["traceEvents"])
    return events / steps, size / steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--skip", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="off/on pairs, in the order off on on off ...")
    p.add_argument("--out", default=os.path.join(benchlib.REPO, "runs", "bench_trace_overhead"))
    args = p.parse_args()
    model = benchlib.quickstart_warm_model(name="trace_overhead")
    order = [m for r in range(args.rounds) for m in (("off", "on") if r % 2 == 0 else ("on", "off"))]
    per_mode: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[dict]] = {"off": [], "on": []}
    hooks: dict[str, list[float]] = {"off": [], "on": []}
    traced = ""
    site = tempfile.mkdtemp(prefix="trace_hooks_")
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(HOOKS)
    os.environ["PYTHONPATH"] = os.pathsep.join([site, os.environ.get("PYTHONPATH", "")])
    for i, mode in enumerate(order):
        run_dir = os.path.join(args.out, f"{mode}_{i}")
        for name in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
            if name.startswith("trace"):
                os.remove(os.path.join(run_dir, name))
        os.environ["MF_TRACE_HOOKS_DIR"] = tempfile.mkdtemp(prefix=f"{mode}_", dir=site)
        rows, mon = benchlib.run_pipeline(model=model, run_dir=run_dir, name="trace_overhead", monitor=True,
                                          overrides=[f"trainer.total_steps={args.steps}",
                                                     f"logging.trace={'true' if mode == 'on' else 'false'}"])
        per_mode[mode].append(benchlib.steady(rows, skip=args.skip, keys=["time_step"])["time_step"])
        cpu[mode].append(cpu_per_step(mon, skip=args.skip))
        hooks[mode].append(round(1e3 * hooks_seconds(os.environ["MF_TRACE_HOOKS_DIR"]) / len(rows), 3))
        benchlib.log("trace_overhead", f"{mode}: {per_mode[mode][-1]:.4f} s/step, CPU s/step {cpu[mode][-1]}, "
                                       f"hooks {hooks[mode][-1]} ms/step")
        traced = run_dir if mode == "on" else traced
    off, on = statistics.fmean(per_mode["off"]), statistics.fmean(per_mode["on"])
    work = {m: statistics.fmean(c["trainer"] + c["engines"] for c in cpu[m]) for m in cpu}
    events, size = trace_size(traced, args.steps)
    cost = cpu_us_per_event()
    print(json.dumps({
        "steps": args.steps, "skip": args.skip, "rounds": args.rounds,
        "time_step_off": per_mode["off"], "time_step_on": per_mode["on"],
        "time_step_off_mean": round(off, 4), "time_step_on_mean": round(on, 4),
        "cpu_s_per_step_off": cpu["off"], "cpu_s_per_step_on": cpu["on"],
        "hooks_ms_per_step_off": hooks["off"], "hooks_ms_per_step_on": hooks["on"],
        "overhead_pct": round(100 * (on / off - 1), 2),
        "cpu_overhead_pct": round(100 * (work["on"] / work["off"] - 1), 2),
        "direct_pct": round(100 * (statistics.fmean(hooks["on"]) - statistics.fmean(hooks["off"])) / 1e3 / off, 3),
        "events_per_step": round(events, 1),
        "trace_bytes_per_step": round(size), "cpu_us_per_event": round(cost, 2),
        "bound_pct": round(100 * events * cost * 1e-6 / off, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
