"""The fault tier, rollout side: one real run (trainer process, real local engine server, real reward
worker process) meets, in order, every fault the rollout side of a long run meets, and then a
pre-emption in the middle of a weight sync. Between the trainer and the engine sits a real HTTP
server (faulty_engine.FaultyEngine) that forwards everything and injects the engine faults.

    prompt 1   the engine refuses it (HTTP 400, too long)     → skipped at once, never sent again
    prompt 3   the engine fails it (HTTP 500) every time      → re-queued max_prompt_retries times, skipped
    prompt 2   the reward raises                              → its group dropped, counted reward_failed
    prompt 4   the reward returns NaN                         → the same
    prompt 5   the reward hangs (one call)                    → killed at rollout.reward_timeout_s, the same
    3 requests HTTP 503 (a burst)                             → each retried once by the proxy, same rid
    1 request  no reply, the connection left open             → abandoned at engines.request_timeout_s, retried
    1 request  HTTP 200 with a body that is not JSON          → its group fails once, the prompt re-queued
    SIGTERM    arrives while the engine receives a weight update → the sync completes, the run saves, exit 0

Asserted from what the test saw itself (the faulty engine's log, the reward's own log, the ledger of
trained prompts, the config): each cause is counted under its metric, every sample admitted is
accounted for (trained + outstanding + dropped + skipped = admitted, nothing trained twice), the
engine and the checkpoint agree on the version, no process is left, no shared memory is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_flash.config import load_config
from megatron_flash.engines.launcher import EngineLauncher
from megatron_flash.ports import free_ports
from tests.conftest import REPO, memfd_links
from tests.faults.faulty_engine import FaultyEngine

N, PROMPTS_PER_STEP, ALPHA = 4, 4, 1
REFUSED, RAISES, FAILS, NAN, HANGS = 1, 2, 3, 4, 5
TAGS = {RAISES: "raise", NAN: "nan", HANGS: "hang"}
SIGTERM_AFTER_ROWS = 6


def rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_dataset(path: str, count: int = 64) -> None:
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(count):
            digits = "".join(rng.sample("123456789", 4))
            f.write(json.dumps({"prompt": f"{TAGS.get(i, 'plain')} {digits}:", "answer": "".join(sorted(digits))}) + "\n")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.serial  # compares /dev/shm before and after: another test's files there would show up
def test_engine_and_reward_faults_are_survived_counted_and_accounted(tiny_models, tmp_path) -> None:
    run_dir, data = str(tmp_path / "run"), str(tmp_path / "prompts.jsonl")
    write_dataset(data)
    overrides = [f"model.hf_path={tiny_models['llama']}", f"logging.dir={run_dir}", "trainer.total_steps=200",
                 f"trainer.global_batch_size={PROMPTS_PER_STEP * N}", f"trainer.micro_batch_size={PROMPTS_PER_STEP * N}",
                 f"rollout.n_samples_per_prompt={N}", f"async_rl.alpha={ALPHA}", f"data.path={data}",
                 "data.shuffle=false", "rollout.reward=tests.faults.fault_rewards:faulty", "rollout.reward_workers=1",
                 "rollout.reward_timeout_s=3", "rollout.max_prompt_retries=1", "engines.request_timeout_s=5",
                 "engines.backend=attach", "engines.num_engines=1", f"checkpoint.save_dir={run_dir}/ckpt",
                 "checkpoint.save_interval=0", "logging.wandb_mode=disabled", "logging.tensorboard=false"]
    prompts = [p.prompt_ids for p in _dataset(overrides)]
    shm_before = set(os.listdir("/dev/shm"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "PYTHONWARNINGS": "ignore",
           "MF_FAULT_DIR": str(tmp_path)}
    launcher = EngineLauncher(backend="local", model_path=tiny_models["llama"], num_engines=1,
                              base_port=free_ports(1), run_dir=str(tmp_path / "engine"), startup_timeout_s=180)
    terminated: list[str] = []
    with launcher, FaultyEngine(launcher.urls[0], prompts, refuse=[REFUSED], error=[FAILS], start_after=24, burst=3,
                                stall=True, garbage=True, spare=list(TAGS)) as faulty:  # their groups fail anyway
        ledger = os.path.join(run_dir, "trained_prompts.jsonl")

        def garbage_prompt() -> int:
            return next(p for _, p, a in list(faulty.events) if a == "garbage")

        def preempt_during_sync(path: str) -> None:
            """Once every fault fired and the garbage group's prompt trained: SIGTERM, mid-sync."""
            if terminated or faulty.pending or len(rows(ledger)) < SIGTERM_AFTER_ROWS:
                return
            if garbage_prompt() not in {i for r in rows(ledger) for i in r["prompt_indices"]}:
                return
            terminated.append(path)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)  # the signal lands while this update is still on its way to the engine

        faulty.on_weight_update = preempt_during_sync
        log_path = tmp_path / "trainer.log"
        with open(log_path, "w") as log:
            t0 = time.monotonic()
            proc = subprocess.Popen([sys.executable, "launch/pretrain_async_rl.py", "--config",
                                     "configs/quickstart_cpu.yaml", *overrides, f"engines.urls=[{faulty.url}]"],
                                    cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                code = proc.wait(timeout=420)
            finally:
                if proc.poll() is None:
                    proc.kill()
        wall = time.monotonic() - t0
        text = log_path.read_text()
        assert code == 0 and terminated, text[-4000:]
        assert "stopping on SIGTERM" in text
        engine_version = _engine_version(launcher.urls[0])
        engine_memfds = memfd_links(launcher.pids[0])
        events = list(faulty.events)

    table = rows(os.path.join(run_dir, "metrics.jsonl"))
    trained = [i for r in rows(ledger) for i in r["prompt_indices"]]
    last = table[-1]

    # --- every step once, every sample accounted for, nothing trained twice
    assert [r["step"] for r in table] == list(range(len(table))) and len(table) >= SIGTERM_AFTER_ROWS
    assert len(trained) == len(set(trained)) == PROMPTS_PER_STEP * len(table)
    assert last["samples_trained"] == N * PROMPTS_PER_STEP * len(table)
    drops = ("dropped_stale", "regenerated_stale", "dropped_filtered", "reward_failed", "dropped_error",
             "samples_cancelled", "samples_skipped")
    for r in table:
        assert r["samples_admitted"] == r["samples_trained"] + r["samples_outstanding"] + sum(r[k] for k in drops), r
    assert not {REFUSED, FAILS, RAISES, NAN, HANGS} & set(trained)

    # --- the refused prompt: one group, refused, never sent again; the failing one: 1 + max_prompt_retries groups
    groups = lambda prompt: {rid.split("-")[0] for rid, p, _ in events if p == prompt}  # noqa: E731
    assert len(groups(REFUSED)) == 1 and {a for _, p, a in events if p == REFUSED} == {"refuse"}
    assert len(groups(FAILS)) == 2 and {a for _, p, a in events if p == FAILS} == {"error"}
    assert sum(r["skipped_prompts"] for r in table) == 2 and sum(r["skipped_after_retries"] for r in table) == 1
    assert last["samples_skipped"] == 2 * N

    # --- transient faults: each faulted request retried (same rid) and served; garbage re-queued once
    for action in ("burst", "stall"):
        hit = [rid for rid, _, a in events if a == action]
        assert len(hit) == (3 if action == "burst" else 1)
        assert all(any(r == rid and a == "forward" for r, _, a in events) for rid in hit), action
    assert sum(r["proxy_retried"] for r in table) >= 4  # 3 × 503 + the stall
    bad = garbage_prompt()
    assert bad in trained and len(groups(bad)) == 2
    assert last["dropped_error"] == N * 2  # the garbage group and the failing prompt's first try

    # --- reward faults: raise, NaN and hang each failed one group (the reward's own log says they ran)
    calls = rows(str(tmp_path / "rewards.jsonl"))
    assert {c["outcome"] for c in calls if c["tag"] == "raise"} == {"raise"}
    assert {c["outcome"] for c in calls if c["tag"] == "nan"} == {"nan"}
    assert [c["outcome"] for c in calls if c["tag"] == "hang"].count("hang") == 1
    assert last["reward_failed"] == 3 * N

    # --- pre-empted mid-sync: the sync finished, the checkpoint is at the engine's version
    with open(os.path.join(run_dir, "ckpt", "latest")) as f:
        meta = json.load(open(os.path.join(run_dir, "ckpt", f.read().strip(), "meta.json")))
    assert str(meta["version"]) == engine_version and meta["step"] == len(table) - 1, (meta, engine_version)

    # --- nothing left behind: no reward worker, no named shared memory; the engine holds one buffer set
    reward_pids = {c["pid"] for c in calls}
    deadline = time.monotonic() + 10
    while any(alive(p) for p in reward_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in reward_pids), reward_pids
    assert set(os.listdir("/dev/shm")) == shm_before
    assert len(engine_memfds) <= 2, engine_memfds
    print(f"{len(table)} steps in {wall:.0f} s; events: " +
          ", ".join(f"{a}={sum(x == a for _, _, x in events)}" for a in ("refuse", "error", "burst", "stall", "garbage")))


def _dataset(overrides: list[str]) -> list:
    from transformers import AutoTokenizer

    from megatron_flash.rollout.dataset import PromptDataset

    cfg = load_config(os.path.join(REPO, "configs", "quickstart_cpu.yaml"), overrides + ["engines.urls=[http://x:1]"])
    return PromptDataset.from_config(cfg.data, AutoTokenizer.from_pretrained(cfg.model.hf_path),
                                     seed=cfg.trainer.seed).prompts


def _engine_version(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url + "/get_weight_version", timeout=10) as r:
        return json.load(r)["weight_version"]

