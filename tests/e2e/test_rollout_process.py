"""rollout.runner=process: the scheduler, proxy, rewards and buffer admission in a spawned process of
their own, the trainer taking whole groups over a pipe. The semantics are the thread runner's:

1. α = 1 run, SIGTERM after a few steps (the pre-emption path takes the checkpoint snapshot from the
   rollout process, which ignores the signal itself), then resumed, again with the process runner, to
   the end: every step once, no prompt trained twice, staleness ≤ α on every row, the sample accounting
   identity on every row, no rollout process left after either run. Both runs write their timeline
   (logging.trace): the rollout process's request spans reach the trainer's trace.json, and the resumed
   run writes trace-1.json beside it instead of overwriting it: every step appears exactly once.
2. The rollout process SIGKILLed mid-run: the trainer stops within its deadline with an error naming
   the process and its exit code, saves the weights it reached, and leaves no engine behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

from megatron_flash.ports import free_ports
from tests.conftest import REPO
from tests.e2e.test_resume import ALPHA, N, PROMPTS_PER_STEP, assert_no_orphan, rows
from tests.e2e.test_resume import command as resume_command

STEPS = 8
DROPS = ("dropped_stale", "regenerated_stale", "dropped_filtered", "reward_failed", "dropped_error",
         "samples_cancelled", "samples_skipped")


def command(model: str, run_dir: str, port: int, *extra: str) -> list[str]:
    """test_resume's run (α = 1, 16-sample steps, checkpoint every step), shorter, with the process runner
    and the `tokens` admission rule (its state crosses the process boundary; the thread runner's e2e
    runs the default rule)."""
    return resume_command(model, run_dir, port, f"trainer.total_steps={STEPS}", "rollout.runner=process",
                          "async_rl.admission=tokens", *extra)


def rollout_pid(log_text: str) -> int:
    found = re.findall(r"rollout loop in process (\d+)", log_text)
    assert found, log_text[-3000:]
    return int(found[-1])


def gone(pid: int, grace_s: float = 10.0) -> bool:
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_process_runner_keeps_alpha_accounting_preemption_and_resume(tiny_models, tmp_path) -> None:
    run_dir = str(tmp_path / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "PYTHONWARNINGS": "ignore"}
    log_path = tmp_path / "first.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command(tiny_models["llama"], run_dir, free_ports(1), "trainer.total_steps=1000",
                                        "logging.trace=true"),
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while len(rows(os.path.join(run_dir, "metrics.jsonl"))) < 3 and time.monotonic() < deadline:
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(120) == 0, log_path.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    first = log_path.read_text()
    assert "stopping on SIGTERM" in first and gone(rollout_pid(first))
    saved = len(rows(os.path.join(run_dir, "metrics.jsonl")))

    resumed = subprocess.run(command(tiny_models["llama"], run_dir, free_ports(1), "logging.trace=true"), cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=300)
    second = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, second[-3000:]
    assert "resumed from" in second and gone(rollout_pid(second))

    table = rows(os.path.join(run_dir, "metrics.jsonl"))
    ledger = rows(os.path.join(run_dir, "trained_prompts.jsonl"))
    assert [r["step"] for r in ledger] == list(range(STEPS)) and saved < STEPS
    trained = [i for r in ledger for i in r["prompt_indices"]]
    assert len(trained) == len(set(trained)) == STEPS * PROMPTS_PER_STEP  # nothing lost or trained twice
    assert all(r["staleness_max"] <= ALPHA for r in table)
    for r in table:
        assert r["samples_admitted"] == r["samples_trained"] + r["samples_outstanding"] + sum(r[k] for k in DROPS), r
    assert table[-1]["samples_trained"] == STEPS * PROMPTS_PER_STEP * N
    steps = []
    for name in ("trace.json", "trace-1.json"):
        with open(os.path.join(run_dir, name)) as f:
            events = json.load(f)["traceEvents"]
        tracks = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
        assert any(tracks[e["pid"]] == "engine 0" and e["ph"] == "X" for e in events), name  # from the process
        assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")
        steps += [int(e["name"].split()[1]) for e in events if e["ph"] == "X" and e["name"].startswith("step ")]
    assert sorted(steps) == list(range(STEPS))


def test_a_killed_rollout_process_stops_the_run_naming_it(tiny_models, tmp_path) -> None:
    run_dir, port = str(tmp_path / "run"), free_ports(1)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "PYTHONWARNINGS": "ignore"}
    log_path = tmp_path / "run.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command(tiny_models["llama"], run_dir, port, "trainer.total_steps=1000"),
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while len(rows(os.path.join(run_dir, "metrics.jsonl"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            victim = rollout_pid(log_path.read_text())
            os.kill(victim, signal.SIGKILL)
            t0 = time.monotonic()
            code = proc.wait(120)
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log_path.read_text()
    assert code != 0, text[-3000:]
    assert f"the rollout process (pid {victim}) died (exit code -9)" in text, text[-3000:]
    assert [d for d in os.listdir(run_dir) if d.startswith("hf_at_stop_v")], os.listdir(run_dir)
    assert_no_orphan(port)
    print(f"stopped {took:.1f} s after the rollout process was killed")
