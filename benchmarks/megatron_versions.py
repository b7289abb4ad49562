"""The CPU quickstart on two megatron-core versions side by side: reward and step time.

    make .venv/.installed && bash tools/compat/install.sh          # 0.16.1 (the lock) and 0.19.2
    OMP_NUM_THREADS=1 python benchmarks/megatron_versions.py --seeds 0,1
    python benchmarks/megatron_versions.py --pythons .venv/bin/python,.cache/compat/megatron-core-0.18.2/bin/python

Each interpreter (one environment per megatron-core: the locked .venv and the compat tier's
.cache/compat/megatron-core-<v>/) runs `launch/quickstart_cpu.py --seed S` — tiny model, format-only
warm-up, then 80 async RL steps through the product's entry point — under runs/megatron_versions/.
Per seed the versions run back to back, the order alternating between seeds, so a slower or busier
stretch of the box falls on both. Reported per run: the reward of the first and last five steps,
the mean RL step time (`rl_seconds_per_step`: rollout wait + train + sync, as the quickstart
reports it) and the wall time of the whole quickstart. Last line: one JSON object, per version
the runs and the means.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def megatron_version(python: str) -> str:
    code = "from importlib.metadata import version; print(version('megatron-core'))"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def quickstart(python: str, *, seed: int, out: str, overrides: list[str]) -> dict[str, Any]:
    start = time.monotonic()
    proc = subprocess.run([python, "launch/quickstart_cpu.py", "--out", out, "--seed", str(seed),
                           "logging.wandb_mode=disabled", "logging.tensorboard=false", *overrides],
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{python} quickstart seed {seed} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"seed": seed, "reward_first5": round(summary["reward_first5"], 4),
            "reward_last5": round(summary["reward_last5"], 4),
            "rl_seconds_per_step": round(summary["rl_seconds_per_step"], 4),
            "wall_s": round(time.monotonic() - start, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pythons", default=".venv/bin/python,.cache/compat/megatron-core-0.19.2/bin/python",
                   help="comma-separated interpreters, one per megatron-core environment")
    p.add_argument("--seeds", default="0")
    p.add_argument("--out", default="runs/megatron_versions")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="passed to the quickstart's RL run")
    args = p.parse_args()
    pythons = [os.path.join(REPO, x) if not os.path.isabs(x) else x for x in args.pythons.split(",")]
    versions = {py: megatron_version(py) for py in pythons}
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in versions.values()}
    for i, seed in enumerate(int(s) for s in args.seeds.split(",")):
        for py in (pythons if i % 2 == 0 else pythons[::-1]):
            version = versions[py]
            row = quickstart(py, seed=seed, out=os.path.join(args.out, f"mcore-{version}-seed{seed}"),
                             overrides=args.overrides)
            runs[version].append(row)
            print(f"megatron-core {version} seed {seed}: reward {row['reward_first5']:.3f} → "
                  f"{row['reward_last5']:.3f}, {row['rl_seconds_per_step']:.3f} s/step, {row['wall_s']} s",
                  flush=True)
    means = {v: {k: round(statistics.mean(r[k] for r in rows), 4)
                 for k in ("reward_first5", "reward_last5", "rl_seconds_per_step", "wall_s")}
             for v, rows in runs.items()}
    print(json.dumps({"runs": runs, "means": means}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
