"""Exact resume on CPU: kill -9 the run at random points, resume each time, account for every prompt.

The ledger `trained_prompts.jsonl` records which prompts (dataset indices; `data.shuffle=false`, so
index = position) each step trained; a resume truncates it to the checkpoint's step. Accounting at
the end: every step exactly once, no prompt trained twice, and the prompts never trained are only
those still outstanding when the run ended (at most (α + 1) batches' worth, all at the end). The run
also exports an HF checkpoint every 10 steps: each whole, none half-written, hf/latest → the last.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import torch

from megatron_flash.ports import free_ports
from tests.conftest import REPO

ALPHA, PROMPTS_PER_STEP, N, STEPS = 1, 4, 4, 30
HF_EVERY = 10  # checkpoint.save_hf_interval


def command(model: str, run_dir: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "launch/pretrain_async_rl.py", "--config", "configs/quickstart_cpu.yaml",
            f"model.hf_path={model}", f"logging.dir={run_dir}", f"trainer.total_steps={STEPS}",
            f"trainer.global_batch_size={PROMPTS_PER_STEP * N}", f"trainer.micro_batch_size={PROMPTS_PER_STEP * N}",
            f"rollout.n_samples_per_prompt={N}", f"async_rl.alpha={ALPHA}", f"engines.base_port={port}",
            "logging.wandb_mode=disabled", "logging.tensorboard=false", "data.shuffle=false",
            "rollout.reward=tests.e2e.toy_rewards:digit_fraction", "loss.name=tis",
            f"checkpoint.save_dir={run_dir}/ckpt", "checkpoint.save_interval=1", "checkpoint.resume=true", *extra]


def start(args: list[str], log_path: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "PYTHONWARNINGS": "ignore"}
    log = open(log_path, "a")
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def engine_alive(port: int) -> bool:
    return subprocess.run(["pgrep", "-f", f"local_server.*--port {port}"], capture_output=True).returncode == 0


def assert_no_orphan(port: int) -> None:
    """The engine server has its own session, but the kernel's parent-death signal stops it when the
    trainer dies, even by SIGKILL (issue: a dead trainer rank must leave no orphans)."""
    deadline = time.monotonic() + 30
    while engine_alive(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = engine_alive(port)
    subprocess.run(["pkill", "-9", "-f", f"local_server.*--port {port}"], check=False)  # never leak one
    assert not alive, f"the engine on port {port} outlived its trainer"


def assert_no_process_of(run_dir: str, grace_s: float = 10.0) -> None:
    """No process whose command line names this run is left (the kernel's parent-death signal takes
    a moment to be delivered and acted on, hence the short grace)."""
    deadline = time.monotonic() + grace_s
    while True:
        left = subprocess.run(["pgrep", "-af", run_dir], capture_output=True, text=True).stdout.strip()
        left = "\n".join(x for x in left.splitlines() if "pgrep" not in x)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"processes of the killed run are still alive:\n{left}"


def test_kill_minus_nine_and_resume_accounts_for_every_prompt(tiny_models, tmp_path) -> None:
    run_dir = str(tmp_path / "run")
    ledger = os.path.join(run_dir, "trained_prompts.jsonl")
    log_path = str(tmp_path / "runs.log")
    rng = random.Random(0)
    kills = 0
    for attempt in range(8):
        port = free_ports(1)
        proc = start(command(tiny_models["llama"], run_dir, port, f"checkpoint.save_hf_interval={HF_EVERY}"),
                     log_path)
        before = len(rows(ledger))
        if kills < 3:
            deadline = time.monotonic() + 180
            target = before + rng.randint(1, 4)
            while time.monotonic() < deadline and proc.poll() is None and len(rows(ledger)) < target:
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.4))  # somewhere inside a later step, sync or checkpoint
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
            proc.wait(60)
            assert_no_orphan(port)
            assert_no_process_of(run_dir)  # e.g. checkpoint writers forked by the killed trainer
            continue
        assert proc.wait(300) == 0, open(log_path).read()[-3000:]
        assert_no_orphan(port)
        break
    assert kills == 3

    ledger_rows = rows(ledger)
    assert [r["step"] for r in ledger_rows] == list(range(STEPS))  # each step exactly once
    trained = [i for r in ledger_rows for i in r["prompt_indices"]]
    assert len(trained) == len(set(trained)) == STEPS * PROMPTS_PER_STEP  # no prompt trained twice
    never = set(range(max(trained) + 1)) - set(trained)
    # Not trained: only prompts still outstanding when the run ended, all drawn late.
    assert len(never) <= (ALPHA + 1) * PROMPTS_PER_STEP, sorted(never)
    assert all(i > sorted(trained)[len(trained) // 2] for i in never), sorted(never)
    metrics = rows(os.path.join(run_dir, "metrics.jsonl"))
    assert all(r["staleness_max"] <= ALPHA for r in metrics)  # the α bound holds across resumes
    print(f"kills={kills}, trained {len(trained)} prompts, never trained {sorted(never)}")

    # HF exports during training, through the kills: one whole export per HF_EVERY steps, nothing
    # half-written left, hf/latest → the last one, which is the run's final weights and loads in
    # transformers.
    hf = os.path.join(run_dir, "ckpt", "hf")
    want = [f"step_{k:06d}" for k in range(HF_EVERY, STEPS + 1, HF_EVERY)]
    assert sorted(os.listdir(hf)) == sorted(want + ["latest"]), os.listdir(hf)
    assert os.readlink(os.path.join(hf, "latest")) == want[-1]
    for name in want:
        index = json.load(open(os.path.join(hf, name, "model.safetensors.index.json")))
        assert index["weight_map"] and os.path.isfile(os.path.join(hf, name, "config.json"))
    from transformers import AutoModelForCausalLM

    from tests.conftest import hf_weights

    final = hf_weights(os.path.join(run_dir, "ckpt", "final_hf"))
    latest = hf_weights(os.path.join(hf, "latest"))
    assert final.keys() == latest.keys() and all(torch.equal(final[k], latest[k]) for k in final)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(hf, "latest"))
    assert torch.isfinite(model(input_ids=torch.tensor([[5, 6, 7]])).logits).all()


def test_sigterm_saves_and_stops_cleanly(tiny_models, tmp_path) -> None:
    run_dir = str(tmp_path / "term")
    port = free_ports(1)
    proc = start(command(tiny_models["llama"], run_dir, port, "trainer.total_steps=500",
                         "checkpoint.save_interval=0"), str(tmp_path / "term.log"))
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and len(rows(os.path.join(run_dir, "metrics.jsonl"))) < 2:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = open(str(tmp_path / "term.log")).read()
    assert "stopping on SIGTERM" in log, log[-3000:]
    with open(os.path.join(run_dir, "ckpt", "latest")) as f:
        name = f.read().strip()
    step = int(name.split("_")[1])
    assert step == len(rows(os.path.join(run_dir, "metrics.jsonl"))) - 1  # saved the last finished step
    # The launcher stopped the engine on the way out.
    assert not engine_alive(port)
