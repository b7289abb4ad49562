"""A real instruct checkpoint learns arithmetic: SmolLM2-135M-Instruct with configs/smollm2_arith_cpu.yaml.

    python tools/fetch_smollm2.py runs/smollm2
    OMP_NUM_THREADS=2 python benchmarks/real_checkpoint.py --seeds 0,1 [--out runs/smollm2_arith] [--reuse]
    (a GPU machine: ... --gpu, which adds the local engine on CUDA in bf16; the trainer takes the GPU itself)

Each seed is one run of `launch/pretrain_async_rl.py` (trainer.seed = the seed), one after the other,
timed from launch to exit. --reuse reads runs already in --out instead of starting them (only plots
and summarises). The plot (--plot) shows, per seed, the training reward per step and the held-out
eval accuracy (mean@4 of add1: one-digit additions; word2: two-digit word problems) at each
evaluation, against wall-clock minutes since launch.

The last line is a JSON object: per seed, the wall time, the eval rows (step, minutes, add1 and word2
mean@4), the rise of add1 from step 0 to the last eval, and the largest train/inference logprob gap
(train_infer_logprob_diff_max, the post-push probe) over the run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/smollm2_arith_cpu.yaml"


def run_seed(seed: int, out: str, extra: list[str]) -> float:
    run_dir = os.path.join(out, f"seed{seed}")
    cmd = [sys.executable, os.path.join(REPO, "launch/pretrain_async_rl.py"), "--config", os.path.join(REPO, CONFIG),
           f"logging.dir={run_dir}", f"trainer.seed={seed}", "logging.wandb_mode=disabled", *extra]
    t0 = time.time()
    with open(os.path.join(out, f"seed{seed}.log"), "w") as log:
        rc = subprocess.call(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    with open(os.path.join(out, f"seed{seed}.start"), "w") as f:
        f.write(f"{int(t0)}\n")
    with open(os.path.join(out, f"seed{seed}.end"), "w") as f:
        f.write(f"{int(time.time())}\n")
    if rc != 0:
        raise SystemExit(f"seed {seed}: run failed (exit {rc}); see {out}/seed{seed}.log")
    return time.time() - t0


def read_run(out: str, seed: int) -> dict[str, Any]:
    run_dir = os.path.join(out, f"seed{seed}")
    with open(os.path.join(out, f"seed{seed}.start")) as f:
        start = int(f.read())
    with open(os.path.join(out, f"seed{seed}.end")) as f:
        end = int(f.read())
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(run_dir, "eval.jsonl")) as f:
        evals = [json.loads(line) for line in f if line.strip()]
    return {"seed": seed, "wall_minutes": round((end - start) / 60, 2), "rows": rows, "evals": evals}


def summarise(run: dict[str, Any]) -> dict[str, Any]:
    """Eval rows with the minutes of training and evaluation behind them: the step-0 evaluation runs
    before any step; a later one (after step k) is inside step k's time_step."""
    evals = []
    before = run["evals"][0]["seconds"] if run["evals"] and run["evals"][0]["step"] == 0 else 0.0
    for e in run["evals"]:
        minutes = (before + (sum(r["time_step"] for r in run["rows"][:e["step"]]) if e["step"] else 0.0)) / 60
        evals.append({"step": e["step"], "minutes_train_and_eval": round(minutes, 2),
                      "add1": round(e["eval/add1/mean@4"], 3), "word2": round(e["eval/word2/mean@4"], 3),
                      "eval_seconds": round(e["seconds"])})
    gaps = [r["train_infer_logprob_diff_max"] for r in run["rows"] if r.get("train_infer_logprob_diff_max") is not None]
    return {"seed": run["seed"], "wall_minutes": run["wall_minutes"], "steps": len(run["rows"]), "evals": evals,
            "add1_rise": round(evals[-1]["add1"] - evals[0]["add1"], 3) if evals else None,
            "word2_rise": round(evals[-1]["word2"] - evals[0]["word2"], 3) if evals else None,
            "train_infer_logprob_diff_max": max(gaps) if gaps else None,
            "reward_first3": round(sum(r["reward_mean"] for r in run["rows"][:3]) / 3, 3),
            "reward_last3": round(sum(r["reward_mean"] for r in run["rows"][-3:]) / 3, 3)}


def plot(runs: list[dict[str, Any]], summaries: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=100)
    for run, summ in zip(runs, summaries):
        ax1.plot(range(1, len(run["rows"]) + 1), [r["reward_mean"] for r in run["rows"]], label=f"seed {run['seed']}")
        xs = [e["minutes_train_and_eval"] for e in summ["evals"]]
        ax2.plot(xs, [e["add1"] for e in summ["evals"]], marker="o", label=f"add1, seed {run['seed']}")
        ax2.plot(xs, [e["word2"] for e in summ["evals"]], marker="s", linestyle="--", label=f"word2, seed {run['seed']}")
    ax1.set_xlabel("train step (4 questions × 8 replies)")
    ax1.set_ylabel("training reward")
    ax1.set_ylim(0, 1)
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    ax2.set_xlabel("minutes of training + evaluation")
    ax2.set_ylabel("held-out mean@4")
    ax2.set_ylim(0, 1)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M-Instruct, arithmetic, CPU box (α = 2, tis)", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--out", default="runs/smollm2_arith")
    p.add_argument("--reuse", action="store_true", help="summarise and plot the runs already in --out")
    p.add_argument("--gpu", action="store_true", help="the local engine on CUDA in bf16 (the trainer uses the GPU)")
    p.add_argument("--plot", default="docs/img/smollm2_arith.png")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = p.parse_args()
    out = os.path.join(REPO, args.out) if not os.path.isabs(args.out) else args.out
    os.makedirs(out, exist_ok=True)
    extra = list(args.overrides)
    if args.gpu:
        extra += ["engines.server_args.device=cuda", "engines.server_args.dtype=bfloat16"]
    seeds = [int(s) for s in args.seeds.split(",")]
    if not args.reuse:
        for seed in seeds:
            run_seed(seed, out, extra)
    runs = [read_run(out, s) for s in seeds]
    summaries = [summarise(r) for r in runs]
    if args.plot:
        plot(runs, summaries, os.path.join(REPO, args.plot))
    print(json.dumps({"config": CONFIG, "seeds": summaries, "plot": args.plot or None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
