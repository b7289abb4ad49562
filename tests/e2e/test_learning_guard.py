"""A CI-sized learning guard: asynchronous tis at α = 2 must learn the quickstart task about as well
as synchronous ppo on the same sample budget. Off-policy learning regressed once without any test
noticing (docs/benchmarks.md, "Asynchronous learning at α = 2"); this catches a repeat in ~2 minutes.

    warm-up    the quickstart's format-only sort4 warm model (300 Megatron steps, warm seed WARM_SEED)
    sync       launch/pretrain_async_rl.py, configs/quickstart_cpu.yaml, α = 0, ppo, 40 steps, seed 1
    async      the same with α = 2, tis (the quickstart's loss), seeds 1 and 2
    statistic  D = mean final reward of the async runs − final reward of the sync run
               (final reward = mean reward of the last 5 steps)

Fails when D < −MARGIN. MARGIN comes from the measured spread (docs/benchmarks.md, the guard's
paragraph): on this warm model one run's final reward has a standard deviation of SD_RUN, so D has
one of about SD_RUN·√1.5; MARGIN is about 4 of those below the measured mean of D, far from a
false alarm, while the regression this guards against (eager admission, the code before
2026-11-27) moved D by about REGRESSION_D on the same model.
"""

from __future__ import annotations

import json
import os
import statistics

from megatron_flash.ports import free_ports
from tests.conftest import run_tool

WARM_SEED = 1
STEPS = 40
MARGIN = 0.25


def final_reward(run_dir: str, last: int = 5) -> float:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert len(rows) == STEPS, f"{run_dir}: {len(rows)} steps"
    return statistics.fmean(r["reward_mean"] for r in rows[-last:])


def test_async_tis_learns_like_sync_ppo(tmp_path) -> None:
    warm = tmp_path / "warm"
    run_tool(["benchmarks/benchlib.py", "warm", "--out", str(warm), "--task", "sort4", "--seed", str(WARM_SEED),
              "--sft-steps", "300"], timeout=600)
    finals = {}
    for name, alpha, loss, seed in (("sync", 0, "ppo", 1), ("async1", 2, "tis", 1), ("async2", 2, "tis", 2)):
        run_dir = str(tmp_path / name)
        run_tool(["launch/pretrain_async_rl.py", "--config", "configs/quickstart_cpu.yaml",
                  f"model.hf_path={warm / 'warm_model'}", f"logging.dir={run_dir}", f"engines.base_port={free_ports(1)}",
                  "logging.wandb_mode=disabled", "logging.tensorboard=false", "checkpoint.save_hf_at_end=false",
                  f"async_rl.alpha={alpha}", f"loss.name={loss}", f"trainer.total_steps={STEPS}",
                  f"trainer.seed={seed}"], timeout=600)
        finals[name] = final_reward(run_dir)
    d = statistics.fmean([finals["async1"], finals["async2"]]) - finals["sync"]
    assert finals["sync"] > 0.3, f"synchronous ppo did not learn the task: {finals}"
    assert d >= -MARGIN, (f"async tis at α = 2 fell {-d:.3f} below sync ppo (margin {MARGIN}): {finals}; compare "
                          "with benchmarks/learning.py --compare REV")
