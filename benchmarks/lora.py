"""LoRA RL against full fine-tuning on the quickstart task, same sample budget, side by side.

    OMP_NUM_THREADS=1 python benchmarks/lora.py --seeds 0,1,2 --runs full@1e-3,r1@1e-2,r8@3e-3,r8@1e-2,r32@3e-3
    OMP_NUM_THREADS=1 python benchmarks/lora.py --seeds 0 --runs r8@3e-3 weight_sync.lora=merged   # any override

A --runs item is `full@LR` (every weight trains, Adam at LR) or `rR@LR` (LoRA rank R on every target,
alpha 32, the base frozen, Adam at LR). Every run is the quickstart (configs/quickstart_cpu.yaml:
sort4 from the format-only warm model, reward starts at chance ≈ 1/24, 16 prompts × 8 samples per
step, α = 2, tis, one local engine) for --steps steps from the same warm model per seed; the items of
a seed run back to back, their order rotating with the seed. LoRA runs push adapters by name
(weight_sync.lora=adapter: the default with the local engine).

`final_reward` is the mean reward of the last 5 steps. Per item: mean ± standard error over seeds,
the paired difference to the first full@ item (same seeds), the optimizer state (train/optimizer_state_gb),
the bytes and seconds per push (sync_gb, time_sync, medians) and the trainer's peak resident set
(train/peak_mem_gb, the last step's: the process's peak so far). The last line is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
from learning import mean_se  # noqa: E402


def item_overrides(item: str) -> list[str]:
    kind, _, lr = item.partition("@")
    if not lr:
        raise SystemExit(f"--runs item {item!r}: expected full@LR or rR@LR")
    out = [f"optimizer.lr={lr}"]
    if kind != "full":
        if not kind.startswith("r") or not kind[1:].isdigit():
            raise SystemExit(f"--runs item {item!r}: expected full@LR or rR@LR")
        out.append(f"model.lora.rank={kind[1:]}")
    return out


def reused(run_dir: str, steps: int) -> list[dict] | None:
    """The rows of a finished run in `run_dir` (all `steps` of them), else None."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows if len(rows) == steps else None


def median(rows: list[dict], key: str, skip: int = 2) -> float:
    vals = [r[key] for r in rows[skip:] if r.get(key) is not None]
    return statistics.median(vals) if vals else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--runs", default="full@1e-3,r1@1e-2,r8@3e-3,r8@1e-2,r32@3e-3")
    p.add_argument("--last", type=int, default=5)
    p.add_argument("--out", default="runs/bench_lora")
    p.add_argument("--reuse", action="store_true", help="read a run already in --out (all its steps) instead of running it")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="more config overrides for every run")
    args = p.parse_args()
    name = "lora"
    seeds = [int(s) for s in args.seeds.split(",")]
    items = args.runs.split(",")
    finals: dict[str, dict[int, float]] = {item: {} for item in items}
    extra: dict[str, list[dict[str, float]]] = {item: [] for item in items}
    t0, load_before = time.time(), benchlib.uptime_load()
    for seed in seeds:
        model = benchlib.quickstart_warm_model(seed=seed, name=name)
        order = items[seed % len(items):] + items[:seed % len(items)]
        for item in order:
            tag = "".join(c if c.isalnum() else "_" for c in item) + f"_s{seed}"
            run_dir = os.path.join(benchlib.REPO, args.out, tag)
            rows = reused(run_dir, args.steps) if args.reuse else None
            if rows is None:
                rows, _ = benchlib.run_pipeline(model=model, run_dir=run_dir, name=name,
                                                overrides=[*item_overrides(item), f"trainer.total_steps={args.steps}",
                                                           f"trainer.seed={seed}", *args.overrides])
            rewards = [r["reward_mean"] for r in rows]
            finals[item][seed] = statistics.fmean(rewards[-args.last:])
            extra[item].append({"optimizer_state_gb": rows[-1].get("train/optimizer_state_gb", float("nan")),
                                "sync_gb": median(rows, "sync_gb"), "time_sync_s": median(rows, "time_sync"),
                                "time_step_s": median(rows, "time_step"),
                                "peak_rss_gb": rows[-1].get("train/peak_mem_gb", float("nan"))})
            benchlib.log(name, f"{item} seed {seed}: reward {statistics.fmean(rewards[:5]):.3f} (first 5) → "
                               f"{finals[item][seed]:.3f} (last {args.last})")
    reference = next((i for i in items if i.startswith("full")), None)
    stats: dict[str, Any] = {}
    for item in items:
        values = [finals[item][s] for s in seeds]
        mean, se = mean_se(values)
        entry: dict[str, Any] = {"mean": mean, "se": se, "n": len(values), "final_reward": [round(v, 4) for v in values]}
        if reference is not None and item != reference:
            diff, diff_se = mean_se([finals[item][s] - finals[reference][s] for s in seeds])
            entry.update(minus_full=diff, minus_full_se=diff_se)
        for key in extra[item][0]:
            entry[key] = round(statistics.fmean(e[key] for e in extra[item]), 6)
        stats[item] = entry
    print(json.dumps({"steps": args.steps, "seeds": seeds, "reference": reference, "stats": stats,
                      "overrides": args.overrides, "load_avg_1m_before": load_before,
                      "seconds": round(time.time() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
