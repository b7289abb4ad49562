"""An elastic fleet on one machine: the product trains with one launched local engine and opens
registration (engines.join_port); two more real engine servers, started outside the run, join it
through launch/fleet_worker.py, serve, and leave on SIGTERM (a preemption) while requests are in
flight. A worker with a wrong key is refused and its engine never gets weights. The run goes on and
ends with every step trained once, no prompt trained twice and staleness within α.
(The same on the Slurm mini-cluster, across hosts: tests/cluster/test_fleet.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from megatron_flash.engines.launcher import EngineCommand, probe_health
from megatron_flash.ports import free_ports
from tests.cluster.jobs import assert_accounted, assert_ledger_exact
from tests.conftest import REPO
from tests.e2e.test_engine_faults import RunWatch

KEY = "fleet-test-key"
STEPS, ALPHA, PROMPTS_PER_STEP = 16, 1, 4


def weight_version(url: str) -> str:
    req = urllib.request.Request(url + "/get_weight_version", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())["weight_version"]


def fleet(address_file: str) -> dict:
    with open(address_file) as f:
        base = json.load(f)["url"]
    req = urllib.request.Request(base + "/fleet", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return {m["url"]: m for m in json.loads(r.read())["members"]}


def test_engines_join_serve_and_leave_a_running_run(tiny_models, tmp_path) -> None:
    ports = free_ports(5)
    run_port, join_port, extra = ports, ports + 1, [ports + 2, ports + 3, ports + 4]
    urls = [f"http://127.0.0.1:{p}" for p in extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    servers = []
    for i, port in enumerate(extra):  # two for the worker, one for the worker with the wrong key
        cmd = EngineCommand.local().build(model_path=tiny_models["llama"], host="127.0.0.1", port=port, api_key=KEY)
        servers.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(tmp_path / f"extra{i}.log", "w"),
                                        stderr=subprocess.STDOUT))
    run_dir = str(tmp_path / "run")
    address = str(tmp_path / "fleet.json")
    args = ["launch/pretrain_async_rl.py", "--config", "configs/quickstart_cpu.yaml",
            f"model.hf_path={tiny_models['llama']}", f"logging.dir={run_dir}", f"trainer.total_steps={STEPS}",
            "trainer.global_batch_size=16", "trainer.micro_batch_size=16", "rollout.n_samples_per_prompt=4",
            f"engines.base_port={run_port}", f"engines.api_key={KEY}", f"engines.join_port={join_port}",
            f"engines.join_address_file={address}", "engines.attach_probe_interval_s=0.5",
            "weight_sync.transport=broadcast", "data.shuffle=false", "rollout.max_new_tokens=24",
            "logging.wandb_mode=disabled", "logging.tensorboard=false", f"async_rl.alpha={ALPHA}"]
    proc = worker = intruder = None
    watch = RunWatch(run_dir)
    worker_log = tmp_path / "worker.log"
    try:
        deadline = time.monotonic() + 180
        while not all(probe_health(u) for u in urls) and time.monotonic() < deadline:
            time.sleep(0.2)
        log = open(tmp_path / "trainer.log", "w")
        proc = subprocess.Popen([sys.executable] + args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        watch.proc = proc
        watch.wait_for(lambda t: len(t) >= 2)
        joined_from = len(watch.rows())
        worker = subprocess.Popen([sys.executable, "launch/fleet_worker.py", "--address-file", address,
                                   "--engine", urls[0], "--engine", urls[1], "--poll-s", "0.5"],
                                  cwd=REPO, env={**env, "SGLANG_API_KEY": KEY}, stdout=open(worker_log, "w"),
                                  stderr=subprocess.STDOUT)
        intruder = subprocess.run([sys.executable, "launch/fleet_worker.py", "--address-file", address,
                                   "--engine", urls[2], "--poll-s", "0.5"], cwd=REPO,
                                  env={**env, "SGLANG_API_KEY": "not-the-key"}, capture_output=True, text=True,
                                  timeout=60)
        table = watch.wait_for(lambda t: any(r.get("engines_joined", 0) >= 2 for r in t))
        joined_at = next(r["step"] for r in table if r.get("engines_joined", 0) >= 2)
        # They serve: the fleet grew to three, and the run's requests go to the new engines too.
        table = watch.wait_for(lambda t: len(t) >= len(table) + 3)
        members = fleet(address)
        versions = [weight_version(u) for u in urls]  # the intruder's engine: never pushed to
        worker.send_signal(signal.SIGTERM)  # a preemption: the worker deregisters both, then exits
        worker.wait(timeout=60)
        left_at = len(watch.rows())
        for server in servers[:2]:  # then their engines go (as a preempted node's would)
            server.kill()
        proc.wait(timeout=600)
    finally:
        for p in (proc, worker, *servers):
            if p is not None and p.poll() is None:
                p.kill()
    out = (tmp_path / "trainer.log").read_text()
    assert proc.returncode == 0, out[-4000:]
    assert worker.returncode == 0, worker_log.read_text()
    assert intruder.returncode == 3, intruder.stdout + intruder.stderr  # 401, never retried
    assert "401" in intruder.stdout
    assert versions[2] == "default"
    table = watch.rows()
    assert len(table) == STEPS
    assert_accounted(table)
    ledger = [json.loads(line) for line in open(os.path.join(run_dir, "trained_prompts.jsonl"))]
    assert_ledger_exact(ledger, steps=STEPS, prompts_per_step=PROMPTS_PER_STEP, alpha=ALPHA)
    assert max(r["staleness_max"] for r in table) <= ALPHA
    assert {u: members[u]["state"] for u in urls[:2]} == {urls[0]: "serving", urls[1]: "serving"}
    assert urls[2] not in members  # the refused worker never registered
    assert all(v != "default" for v in versions[:2])  # the joiners got the trainer's weights
    last = table[-1]
    assert last["engines_joined"] == 2 and last["engines_left"] == 2, last
    assert max(r["fleet_size"] for r in table) == 3 and last["fleet_size"] == 1
    served = sum(r.get("engine1_requests", 0) + r.get("engine2_requests", 0) for r in table[joined_at:left_at])
    assert served > 0, "the joined engines served no request"
    assert "deregistered" in worker_log.read_text()
    print(f"joined at step {joined_at} (worker started after step {joined_from - 1}); left after step "
          f"{left_at - 1}; re-issued {last['requests_reissued']:.0f}; {served:.0f} requests on the joiners")
