"""The fault tier, training side: blown-up weights in a real run (trainer + local engine). With a
learning rate of 1e30 the first optimizer step has finite gradients (so the non-finite-gradient guard
lets it through) but leaves weights of ~1e30, whose logits would overflow: NaN. The trainer's check of
its own weights after the step (trainer/weight_health.py) must stop the run before that first push,
naming the cause, with the weights saved under the version they are (hf_at_stop_v1), no engine left,
and no sample trained on them. An isolated poisoned batch (NaN gradient: the update skipped, the next batch trains) and
trainer.max_nonfinite_steps in a row (the run stops, the batch dumped) go through the real Megatron
trainer in tests/distributed/test_nonfinite.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from megatron_flash.ports import free_ports
from tests.conftest import REPO


def test_weights_blown_up_by_a_finite_update_stop_the_run_before_the_push(tiny_models, tmp_path) -> None:
    from tests.e2e.test_resume import assert_no_orphan

    run_dir = str(tmp_path / "run")
    port = free_ports(1)
    args = [sys.executable, "launch/pretrain_async_rl.py", "--config", "configs/quickstart_cpu.yaml",
            f"model.hf_path={tiny_models['llama']}", f"logging.dir={run_dir}", "trainer.total_steps=20",
            "trainer.global_batch_size=16", "trainer.micro_batch_size=16", "rollout.n_samples_per_prompt=4",
            "async_rl.alpha=1", f"engines.base_port={port}", "rollout.reward=tests.e2e.toy_rewards:digit_fraction",
            "optimizer.lr=1e30", "optimizer.clip_grad=0", "logging.wandb_mode=disabled", "logging.tensorboard=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "PYTHONWARNINGS": "ignore"}
    t0 = time.monotonic()
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "the optimizer step at policy version 0 left non-finite weights" in out, out[-3000:]
    assert "the engines still serve version 0" in out and "post-sync probe" not in out, out[-3000:]
    assert_no_orphan(port)
    logged = [line for line in out.splitlines() if " megatron_flash." in line]  # the controller's log lines
    assert logged and "loss tis: ratio ρ = π_θ/μ" in logged[0] and "async_rl.alpha=1" in logged[0], logged[:3]
    # Stopped before the first push: no step was logged, nothing trained on the NaN policy's samples.
    metrics = os.path.join(run_dir, "metrics.jsonl")
    assert not os.path.exists(metrics) or not open(metrics).read().strip()
    assert [d for d in os.listdir(run_dir) if d.startswith("hf_at_stop_v")] == ["hf_at_stop_v1"]
    print(f"stopped {time.monotonic() - t0:.0f} s after start: "
          f"{next(x for x in out.splitlines() if 'left non-finite weights' in x)[:200]}")


def test_a_filter_that_keeps_nothing_stops_the_run_at_its_deadline_saying_where_samples_went(tiny_models,
                                                                                           tmp_path) -> None:
    """Every group dropped by the dynamic filter: no batch can fill, so at async_rl.batch_timeout_s the
    run stops, and the error says what was waited on and where every admitted sample went."""
    from tests.e2e.test_resume import assert_no_orphan

    run_dir, port = str(tmp_path / "run"), free_ports(1)
    args = [sys.executable, "launch/pretrain_async_rl.py", "--config", "configs/quickstart_cpu.yaml",
            f"model.hf_path={tiny_models['llama']}", f"logging.dir={run_dir}", "trainer.total_steps=20",
            "trainer.global_batch_size=16", "trainer.micro_batch_size=16", "rollout.n_samples_per_prompt=4",
            f"engines.base_port={port}", "rollout.dynamic_filter=tests.faults.fault_rewards:drop_every_group",
            "async_rl.batch_timeout_s=8", "logging.wandb_mode=disabled", "logging.tensorboard=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert_no_orphan(port)
    line = next((x for x in out.splitlines() if "no training batch at policy version 0" in x), "")
    assert "within 8 s" in line, out[-3000:]
    admitted = int(line.split("of ")[-1].split(" samples admitted")[0])
    filtered = int(line.split(" dropped by rollout.dynamic_filter=tests.faults.fault_rewards:drop_every_group")[0]
                   .split(", ")[-1])
    assert admitted > 0 and 0 < filtered <= admitted and filtered % 4 == 0, line  # whole groups of 4
    assert ", 0 trained," in line
