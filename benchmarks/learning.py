"""Learning at α = 2 with each off-policy loss vs synchronous (α = 0) ppo, same sample budget.

    OMP_NUM_THREADS=1 python benchmarks/learning.py [--steps 40] [--seeds 0] [--losses ppo,decoupled_ppo,tis,cispo,topr]
    OMP_NUM_THREADS=1 python benchmarks/learning.py --seeds 0,1 \
        --losses gspo/seq_mean_token_mean,decoupled_ppo/seq_mean_token_sum,decoupled_ppo/seq_mean_token_sum_norm

A --losses item is `loss` or `loss/aggregation` (loss.aggregation; default token_mean).

Task: the quickstart (configs/quickstart_cpu.yaml): sort4 from the format-only warm model (reward
starts at chance, ≈ 1/24), 16 prompts × 8 samples per step, Adam lr 1e-3, one CPU engine server.
Every run trains --steps steps on --steps × 128 samples; runs differ only in α and the loss:

  sync   α = 0, ppo (on-policy: π_prox = μ up to engine/trainer numerics)
  async  α = --alpha with each loss of --losses (samples up to α versions old)

`final_reward` is the mean reward of the last 5 steps (the samples each step trained on). The paper
(ROLL Flash) reports parity of async with off-policy corrections vs sync. Curves go to --plot (PNG).
The warm model is launch/quickstart_cpu.py's warm-up (built once per seed, cached in runs/bench_models).

The last line is a JSON object: final reward per (mode, loss) and seed, their means, and
`ratio_best_async_to_sync` = best async loss's mean final reward / sync ppo's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402


def plot(curves: dict[str, dict[int, list[float]]], path: str, *, alpha: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
    for label, by_seed in curves.items():
        runs = list(by_seed.values())
        steps = min(len(r) for r in runs)
        mean = [statistics.fmean(r[i] for r in runs) for i in range(steps)]
        style = {"color": "black", "linewidth": 2.2} if label.startswith("sync") else {"linewidth": 1.3}
        ax.plot(range(1, steps + 1), mean, label=label, **style)
    ax.set_xlabel("train step (128 samples each)")
    ax.set_ylabel("reward (mean over seeds)")
    ax.set_title(f"sort4, tiny Llama on CPU: α = {alpha} losses vs synchronous ppo", fontsize=10)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", default="0", help="comma-separated, e.g. 0,1; each seed: its own warm model and run seed")
    p.add_argument("--alpha", type=int, default=2)
    p.add_argument("--losses", default="ppo,decoupled_ppo,tis,cispo,topr", help="losses run at --alpha")
    p.add_argument("--last", type=int, default=5, help="final reward = mean over this many last steps")
    p.add_argument("--plot", default="docs/img/learning_alpha2.png")
    p.add_argument("--out", default="runs/bench_learning")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="more config overrides for every run")
    args = p.parse_args()
    name = "learning"
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = [("sync ppo", 0, "ppo")] + [(f"α={args.alpha} {item}", args.alpha, item) for item in args.losses.split(",")]
    curves: dict[str, dict[int, list[float]]] = {label: {} for label, _, _ in runs}
    final: dict[str, dict[int, float]] = {label: {} for label, _, _ in runs}
    t0, load_before = time.time(), benchlib.uptime_load()
    for seed in seeds:
        model = benchlib.quickstart_warm_model(seed=seed, name=name)
        for label, alpha, item in runs:
            loss, _, aggregation = item.partition("/")
            run_dir = os.path.join(benchlib.REPO, args.out, f"a{alpha}_{item.replace('/', '_')}_s{seed}")
            rows, _ = benchlib.run_pipeline(model=model, run_dir=run_dir, name=name, overrides=[
                f"async_rl.alpha={alpha}", f"loss.name={loss}", f"loss.aggregation={aggregation or 'token_mean'}",
                f"trainer.total_steps={args.steps}", f"trainer.seed={seed}", *args.overrides])
            rewards = [r["reward_mean"] for r in rows]
            curves[label][seed] = rewards
            final[label][seed] = statistics.fmean(rewards[-args.last:])
            benchlib.log(name, f"{label} seed {seed}: reward {statistics.fmean(rewards[:5]):.3f} (first 5) → "
                               f"{final[label][seed]:.3f} (last {args.last})")
    plot_path = os.path.join(benchlib.REPO, args.plot)
    plot(curves, plot_path, alpha=args.alpha)
    means = {label: round(statistics.fmean(v.values()), 4) for label, v in final.items()}
    sync = means["sync ppo"]
    best_label = max((lbl for lbl in means if not lbl.startswith("sync")), key=means.get)
    result = {
        "steps": args.steps, "samples_per_run": args.steps * 128, "alpha": args.alpha, "seeds": seeds,
        "final_reward": {label: {str(s): round(v, 4) for s, v in by.items()} for label, by in final.items()},
        "final_reward_mean": means, "best_async": best_label,
        "ratio_best_async_to_sync": round(means[best_label] / sync, 3) if sync > 0 else None,
        "plot": os.path.relpath(plot_path, benchlib.REPO), "load_avg_1m_before": load_before,
        "seconds": round(time.time() - t0, 1),
    }
    print(json.dumps(result, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
