"""Fault test: kill one of two real local engine servers (by pid) while requests are in flight through
the proxy. Every request must complete exactly once, on the survivor, with a full answer."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from megatron_flash.ports import free_ports
from megatron_flash.rollout.proxy import LLMProxy
from megatron_flash.engines.launcher import EngineLauncher, probe_health



@pytest.fixture
def two_engines(tiny_models, tmp_path):
    launcher = EngineLauncher(backend="local", model_path=tiny_models["llama"], num_engines=2,
                              base_port=free_ports(2), run_dir=str(tmp_path), startup_timeout_s=180)
    with launcher:  # __enter__ starts the servers and waits for /health
        yield launcher


def test_killing_an_engine_loses_and_duplicates_nothing(two_engines) -> None:
    urls, pids = two_engines.urls, two_engines.pids
    num_requests, length = 24, 24

    async def scenario():
        async with LLMProxy.from_urls(urls, max_inflight_per_engine=4, health_check_interval_s=0.5) as proxy:
            params = {"temperature": 1.0, "max_new_tokens": length, "ignore_eos": True}
            tasks = [asyncio.create_task(proxy.generate([5, 6, 7, 8], params, rid=f"req-{i}"))
                     for i in range(num_requests)]
            # Wait until the victim is busy, then kill it mid-generation.
            for _ in range(400):
                if proxy.metrics().as_dict()["proxy/engine0/inflight"] > 0:
                    break
                await asyncio.sleep(0.025)
            os.kill(pids[0], signal.SIGKILL)
            results = await asyncio.gather(*tasks)
            return results, proxy.metrics().as_dict()

    results, metrics = asyncio.run(scenario())
    assert sorted(r.rid for r in results) == sorted(f"req-{i}" for i in range(num_requests))
    assert all(r.finish_reason == "length" and len(r.output_ids) == length for r in results)
    assert all(len(r.output_logprobs) == length for r in results)
    # Requests that were on the killed engine were re-run on the survivor.
    assert metrics["proxy/retried"] >= 1
    assert metrics["proxy/engine0/healthy"] == 0.0
    assert sum(r.engine_url == urls[1] for r in results) >= num_requests - metrics["proxy/engine0/completed"]


def weight_version(url: str) -> str:
    with urllib.request.urlopen(url + "/get_weight_version", timeout=10) as r:
        return json.load(r)["weight_version"]


def fleet_versions_when_idle(urls: list, timeout_s: float = 60.0) -> list:
    """Both engines' versions read back to back between two pushes. The run keeps pushing while this
    reads, so one pair may straddle a push; an engine really left behind never agrees within the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        versions = [weight_version(u) for u in urls]
        if len(set(versions)) == 1 or time.monotonic() > deadline:
            return versions
        time.sleep(0.05)


def rejoined(table: list) -> list:
    """The steps whose push re-synced a restarted engine."""
    return [r for r in table if r.get("engines_restarted")]


def back_and_serving(table: list) -> bool:
    """A restarted engine was re-synced and, at a later step, both engines were healthy."""
    back = rejoined(table)
    return bool(back) and any(r["engines_healthy"] == 2 for r in table if r["step"] > back[0]["step"])


def assert_restarted_once_and_resynced(table: list, killed_after: int, fleet_versions: list) -> dict:
    """Engine 0 (killed after `killed_after` rows) came back once, was re-synced, and served again."""
    assert [r["step"] for r in table] == list(range(len(table)))
    first = rejoined(table)
    assert len(first) == 1, [(r["step"], r.get("engines_restarted")) for r in table]
    first = first[0]
    assert first["step"] >= killed_after - 1 and first["engine_restart_s"] > 0
    # The push that re-admitted it probed every synced engine: the restarted one serves the trainer's weights.
    assert first["engines_out_of_service"] == 0 and first["train_infer_logprob_diff"] <= 1e-4, first
    assert table[-1]["engine_restarts"] == 1 and table[-1]["engines_healthy"] == 2
    # ...and it generated again after the re-sync (the proxy's per-engine completions of each step's window).
    later = [r for r in table if r["step"] > first["step"] + 1]
    assert sum(r["engine0_requests"] for r in later) > 0, [(r["step"], r["engine0_requests"]) for r in table]
    assert fleet_versions[0] == fleet_versions[1], fleet_versions  # both engines at the trainer's weights
    return first


class RunWatch:
    """The rows of a run's metrics.jsonl as the run writes them; `proc` is the run."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.proc: subprocess.Popen | None = None

    def rows(self) -> list:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def wait_for(self, what, timeout_s: float = 300.0) -> list:
        alive = lambda: self.proc is not None and self.proc.poll() is None  # noqa: E731
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and alive():
            table = self.rows()
            if what(table):
                return table
            time.sleep(0.2)
        raise AssertionError(f"gave up waiting; run alive: {alive()}; last rows: {self.rows()[-3:]}")


@pytest.mark.serial  # compares /dev/shm before and after: another test's files there would show up
def test_launcher_restarts_a_killed_engine_and_the_run_resyncs_it(tiny_models, tmp_path) -> None:
    """The product with two launched local engines; engine 0 is killed (-9) mid-run. The launcher
    must start it again, the next push must send it the trainer's weights, and it must serve again
    (the proxy re-admits it only at the fleet's version). The run is long; once that is seen it is
    stopped by SIGTERM (the pre-emption path) and must exit cleanly with no engine left behind.
    The rollout loop runs in its own process here (rollout.runner=process): the launcher and its
    supervisor stay with the trainer and reach the proxy over the event pipe; the other restart tests
    cover the thread runner."""

    from tests.conftest import REPO

    run_dir = str(tmp_path / "restart")
    port = free_ports(2)
    args = ["launch/pretrain_async_rl.py", "--config", "configs/quickstart_cpu.yaml",
            f"model.hf_path={tiny_models['llama']}", f"logging.dir={run_dir}", "trainer.total_steps=100000",
            "trainer.global_batch_size=16", "trainer.micro_batch_size=16", "rollout.n_samples_per_prompt=4",
            "engines.num_engines=2", f"engines.base_port={port}", "engines.max_restarts=1",
            "logging.wandb_mode=disabled", "logging.tensorboard=false", "async_rl.alpha=1",
            "rollout.runner=process"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen([sys.executable] + args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    watch = RunWatch(run_dir)
    watch.proc = proc
    pid_path = os.path.join(run_dir, "engines", "engine_0.pid")

    try:
        watch.wait_for(lambda t: len(t) >= 3)
        with open(pid_path) as f:
            victim = int(f.read())
        killed_after = len(watch.rows())
        os.kill(victim, signal.SIGKILL)
        table = watch.wait_for(back_and_serving)
        watch.wait_for(lambda t: len(t) >= len(table) + 3)  # it keeps serving for a few more steps
        with open(pid_path) as f:
            survivor = int(f.read())
        fleet_versions = fleet_versions_when_idle([f"http://127.0.0.1:{port + i}" for i in range(2)])
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    assert set(os.listdir("/dev/shm")) == shm_before  # staged ipc buffers are memfds: nothing named, nothing left
    assert survivor != victim  # a new process serves engine 0
    table = watch.rows()
    first = assert_restarted_once_and_resynced(table, killed_after, fleet_versions)
    with open(os.path.join(run_dir, "engines", "engine_0.log")) as f:
        starts = [line for line in f if line.startswith("# engine 0:")]
    assert len(starts) == 2, starts
    for pid in (victim, survivor):  # nothing left behind after the stop
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    print(f"engine 0 killed after step {killed_after - 1}; restarted in {first['engine_restart_s']:.1f} s; "
          f"re-synced at step {first['step']}; {len(table)} steps")


def test_attached_engines_restarted_on_their_node_are_resynced_and_serve_again(tiny_models, tmp_path) -> None:
    """The multi-node layout on one machine: two local engine servers started outside the run, each under
    launch/slurm/engine_loop.sh (what the template's engine steps run), and the product attached to
    them (engines.backend=attach). Engine 0's server is killed (-9) mid-run: the trainer must take it
    out when its /health fails, the loop must start it again, and once it answers the next push must
    send it the trainer's weights and the proxy must route to it again; the run never stops."""
    import shlex

    from megatron_flash.engines.launcher import EngineCommand
    from tests.conftest import REPO

    port = free_ports(2)
    urls = [f"http://127.0.0.1:{port + i}" for i in range(2)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "RESTART_DELAY_S": "0.5"}
    cpu = EngineCommand.local()
    loops = []
    for i in range(2):
        cmd = shlex.join(cpu.build(model_path=tiny_models["llama"], host="127.0.0.1", port=port + i))
        loops.append(subprocess.Popen(["bash", "launch/slurm/engine_loop.sh", "2", str(tmp_path / f"engine{i}.log"),
                                       cmd], cwd=REPO, env=env))

    def server_pid(loop: subprocess.Popen) -> int:
        with open(f"/proc/{loop.pid}/task/{loop.pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
        assert len(kids) == 1, kids
        return kids[0]

    run_dir = str(tmp_path / "attach")
    args = ["launch/pretrain_async_rl.py", "--config", "configs/quickstart_cpu.yaml",
            f"model.hf_path={tiny_models['llama']}", f"logging.dir={run_dir}", "trainer.total_steps=100000",
            "trainer.global_batch_size=16", "trainer.micro_batch_size=16", "rollout.n_samples_per_prompt=4",
            "engines.backend=attach", "engines.num_engines=2", f"engines.urls=[{urls[0]},{urls[1]}]",
            "engines.attach_probe_interval_s=0.2", "engines.attach_probe_failures=2",
            "logging.wandb_mode=disabled", "logging.tensorboard=false", "async_rl.alpha=1"]
    proc = None
    watch = RunWatch(run_dir)

    try:
        deadline = time.monotonic() + 180
        while not all(probe_health(u) for u in urls) and time.monotonic() < deadline:
            time.sleep(0.2)
        # Output to a file, not a pipe: torch's shared-memory manager, which the trainer starts for the ipc
        # transport, inherits it and lives on while the attached engines (its clients) do.
        log = open(tmp_path / "trainer.log", "w")
        proc = subprocess.Popen([sys.executable] + args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        watch.proc = proc
        watch.wait_for(lambda t: len(t) >= 3)
        victim = server_pid(loops[0])
        killed_after = len(watch.rows())
        os.kill(victim, signal.SIGKILL)
        table = watch.wait_for(back_and_serving)
        watch.wait_for(lambda t: len(t) >= len(table) + 3)  # it keeps serving for a few more steps
        survivor = server_pid(loops[0])
        fleet_versions = fleet_versions_when_idle(urls)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        codes = []
        for loop in loops:
            loop.send_signal(signal.SIGTERM)
            try:
                codes.append(loop.wait(timeout=60))
            except subprocess.TimeoutExpired:
                loop.kill()
                codes.append(None)
    log.close()
    assert proc.returncode == 0, (tmp_path / "trainer.log").read_text()[-4000:]
    assert codes == [143, 143]  # the loops stopped their servers on SIGTERM
    assert survivor != victim  # the loop started a new server for engine 0
    table = watch.rows()
    first = assert_restarted_once_and_resynced(table, killed_after, fleet_versions)
    with open(tmp_path / "engine0.log") as f:
        text = f.read()
    assert text.count("started (pid") == 2 and "starting it again" in text
    for pid in (victim, survivor):
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    print(f"attached engine 0 killed after step {killed_after - 1}; back and re-synced at step {first['step']} "
          f"({first['engine_restart_s']:.1f} s down → healthy); {len(table)} steps")


def test_supervisor_restarts_up_to_max_restarts_then_leaves_it_down(tiny_models, tmp_path) -> None:
    downs = []
    launcher = EngineLauncher(backend="local", model_path=tiny_models["llama"], num_engines=1,
                              base_port=free_ports(1), run_dir=str(tmp_path), startup_timeout_s=180)
    with launcher:
        url = launcher.urls[0]
        launcher.supervise(max_restarts=1, on_down=lambda u, why: downs.append((u, why)), interval_s=0.1)
        first = launcher.pids[0]
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 180
        restarted: list = []
        while not restarted and time.monotonic() < deadline:
            restarted = launcher.take_restarted()
            time.sleep(0.1)
        assert restarted == [url]
        second = launcher.pids[0]
        assert second != first and probe_health(url)
        assert launcher.take_restarted() == []  # reported once
        os.kill(second, signal.SIGKILL)
        while not launcher.gave_up and time.monotonic() < deadline:
            time.sleep(0.1)
        assert launcher.gave_up == [0]
        assert launcher.pids == [second]  # not started a third time
        assert not probe_health(url)
    assert [u for u, _ in downs] == [url, url]
    assert "exited with code -9" in downs[0][1]
    assert len(launcher.restarts) == 1 and launcher.restarts[0]["ok"] and launcher.restarts[0]["restart_s"] > 0
    with open(os.path.join(str(tmp_path), "engines", "engine_0.pid")) as f:
        assert int(f.read()) == second


def test_colocated_run_releases_engine_memory_every_step_and_serves_pushed_weights(tiny_models, tmp_path) -> None:
    """engines.colocate=true: before each train step both engines pause and release their memory;
    the push takes it back (weights, new values, KV cache). Every step's probe must find the engines
    serving exactly the trainer's weights (a missed push would leave zeros), staleness 0."""

    from tests.conftest import REPO

    run_dir = str(tmp_path / "colocate")
    port, steps = free_ports(2), 8
    args = ["launch/pretrain_async_rl.py", "--config", "configs/quickstart_cpu.yaml",
            f"model.hf_path={tiny_models['llama']}", f"logging.dir={run_dir}", f"trainer.total_steps={steps}",
            "trainer.global_batch_size=16", "trainer.micro_batch_size=16", "rollout.n_samples_per_prompt=4",
            "engines.num_engines=2", f"engines.base_port={port}", "engines.colocate=true", "async_rl.alpha=0",
            "logging.wandb_mode=disabled", "logging.tensorboard=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable] + args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    releases = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if os.path.exists(metrics_path) and sum(1 for _ in open(metrics_path)) >= 4:
                for i in range(2):
                    with urllib.request.urlopen(f"http://127.0.0.1:{port + i}/get_server_info", timeout=10) as r:
                        releases.append(json.load(r)["memory_releases"])
                break
            time.sleep(0.2)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert [r["step"] for r in rows] == list(range(steps))
    assert len(releases) == 2 and min(releases) >= 4, releases  # each engine released at every step so far
    for r in rows:
        assert r["time_release"] > 0 and r["staleness_max"] == 0 and r["engines_out_of_service"] == 0, r
        assert r["train_infer_logprob_diff"] <= 1e-4, r
