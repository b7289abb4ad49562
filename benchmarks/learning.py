"""Learning at α = 2 with each off-policy loss vs synchronous (α = 0) ppo, same sample budget.

    OMP_NUM_THREADS=1 python benchmarks/learning.py [--steps 40] [--seeds 0] [--losses ppo,decoupled_ppo,tis,cispo,topr]
    OMP_NUM_THREADS=1 python benchmarks/learning.py --seeds 0,1 \
        --losses gspo/seq_mean_token_mean,decoupled_ppo/seq_mean_token_sum,decoupled_ppo/seq_mean_token_sum_norm

    OMP_NUM_THREADS=1 python benchmarks/learning.py --seeds 0,1,2 --repeats 4 --losses tis --no-sync --compare REV

A --losses item is `loss`, `loss/aggregation` (loss.aggregation; default token_mean), and may end in
`@key=value,...` with more loss.* settings for that item only, e.g. `gspo/seq_mean_token_mean@params.
behavior_weight=none` (GSPO without its behaviour weight) or `decoupled_ppo@prox_logprobs=approximate`.

--compare REV runs another commit's code (its launcher, package and quickstart config, exported once
under runs/compare/) beside this checkout's, on the same warm models (built by this checkout), each
(seed, run, loss) back to back with the order alternating, and reports both codes' mean ± standard
error and the paired difference per loss: one run is noise here (seed 0 alone spans 0.0–0.7), so
see a 0.1 effect with ≥ 12 runs per code. --this REV puts another commit in the checkout's place.

Task: the quickstart (configs/quickstart_cpu.yaml): sort4 from the format-only warm model (reward
starts at chance, ≈ 1/24), 16 prompts × 8 samples per step, Adam lr 1e-3, one local engine server.
Every run trains --steps steps on --steps × 128 samples; runs differ only in α and the loss:

  sync   α = 0, ppo (on-policy: π_prox = μ up to engine/trainer numerics)
  async  α = --alpha with each loss of --losses (samples up to α versions old); a loss without behaviour
         correction (ppo, reinforce) runs with loss.allow_uncorrected=true: measuring it is the point

`final_reward` is the mean reward of the last 5 steps (the samples each step trained on). The paper
(ROLL Flash) reports parity of async with off-policy corrections vs sync. Curves go to --plot (PNG).
The warm model is launch/quickstart_cpu.py's warm-up (built once per seed, cached in runs/bench_models).

The last line is a JSON object: final reward per (mode, loss), seed and run; `stats` (mean, se, n,
collapsed = runs ending below 0.1); `diagnostics` (per-run medians over steps ≥ 3, then averaged: how
far the policy sits from μ, the labelled-version gap, step time); with --compare the same for REV
under `compare` and `compare.difference` (this − REV, paired); `ratio_best_async_to_sync` = best
async loss's mean final reward / sync ppo's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Optional

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
    benchlib.finish_reward_plot(fig, [ax], path, ylabel="reward (mean over seeds)",
                                titles=[f"sort4, tiny Llama on CPU: α = {alpha} losses vs synchronous ppo"])


DIAGNOSTICS = ("train/mismatch_abs", "train/approx_kl", "train/grad_norm", "train/is_weight_mean",
               "staleness_token_mean", "rollout_lookahead", "admission/sit_s", "time_rollout_wait",
               "mismatch_labelled_abs", "time_step", "time_train")


def item_overrides(item: str, *, alpha: int, code: str) -> list[str]:
    """Config overrides of one --losses item (see the module docstring), with the opt-in an
    uncorrected loss needs at α > 0."""
    spec, _, extra = item.partition("@")
    loss, _, aggregation = spec.partition("/")
    settings = [f"loss.{kv.strip()}" for kv in extra.split(",") if kv.strip()]
    params = {}
    for kv in settings:
        key, _, value = kv.partition("=")
        if key.startswith("loss.params."):
            params[key.removeprefix("loss.params.")] = _value(value)
    return [f"loss.name={loss}", f"loss.aggregation={aggregation or 'token_mean'}", *settings,
            *benchlib.uncorrected_opt_in(loss, alpha, code=code, params=params)]


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text
COLLAPSED = 0.1  # a final reward below this (chance is ≈ 0.04) counts as a collapse


def mean_se(values: list[float]) -> tuple[float, Optional[float]]:
    """Mean and standard error of the mean (None for a single value)."""
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return round(statistics.fmean(values), 4), None if se is None else round(se, 4)


def summarize(finals: list[float]) -> dict[str, Any]:
    """Mean, standard error of the mean, n and collapses of a list of final rewards."""
    mean, se = mean_se(finals)
    return {"mean": mean, "se": se, "n": len(finals), "collapsed": sum(f < COLLAPSED for f in finals)}


def diagnostics(rows: list[dict], *, skip: int = 3) -> dict[str, float]:
    """Medians over steps ≥ skip of the metrics that show how far each update moves the policy."""
    out = {}
    for key in DIAGNOSTICS:
        vals = [r[key] for r in rows[skip:] if r.get(key) is not None]
        if vals:
            out[key] = statistics.median(vals)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", default="0", help="comma-separated, e.g. 0,1; each seed: its own warm model and run seed")
    p.add_argument("--repeats", type=int, default=1, help="runs per seed and loss (and per revision)")
    p.add_argument("--alpha", type=int, default=2)
    p.add_argument("--losses", default="ppo,decoupled_ppo,tis,cispo,topr", help="losses run at --alpha")
    p.add_argument("--no-sync", action="store_true", help="skip the synchronous ppo reference runs")
    p.add_argument("--admission", default="", help="async_rl.admission of the α > 0 runs (default: the schema's)")
    p.add_argument("--compare", default="", metavar="REV",
                   help="also run this git revision's code (launcher, package, config) on the same warm models, "
                        "interleaved with this checkout's runs")
    p.add_argument("--this", default="", metavar="REV",
                   help="run this git revision's code in place of the checkout's (e.g. to compare two old commits)")
    p.add_argument("--last", type=int, default=5, help="final reward = mean over this many last steps")
    p.add_argument("--plot", default="docs/img/learning_alpha2.png", help="'' = no plot")
    p.add_argument("--out", default="runs/bench_learning")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="more config overrides for every run")
    args = p.parse_args()
    name = "learning"
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = [] if args.no_sync else [("sync ppo", 0, "ppo")]
    runs += [(f"α={args.alpha} {item}", args.alpha, item) for item in args.losses.split(",")]
    codes = [(benchlib.head_label(), benchlib.REPO)]
    if args.this:
        commit, tree = benchlib.checkout(args.this, name=name)
        codes = [(commit[:12], tree)]
    if args.compare:
        commit, tree = benchlib.checkout(args.compare, name=name)
        codes.append((commit[:12], tree))
    curves: dict[str, dict[str, list[float]]] = {label: {} for label, _, _ in runs}
    finals = {code: {label: {} for label, _, _ in runs} for code, _ in codes}
    diag: dict[str, dict[str, list[dict]]] = {code: {label: [] for label, _, _ in runs} for code, _ in codes}
    t0, load_before = time.time(), benchlib.uptime_load()
    for seed in seeds:
        model = benchlib.quickstart_warm_model(seed=seed, name=name)
        for rep in range(args.repeats):
            for label, alpha, item in runs:
                # Alternate which code runs first, so neither always meets the box right after the other.
                admission = [f"async_rl.admission={args.admission}"] if args.admission and alpha else []
                for code, tree in (codes if rep % 2 == 0 else codes[::-1]):
                    safe = "".join(c if c.isalnum() or c in "_-" else "_" for c in item)
                    tag = f"a{alpha}_{safe}_s{seed}_r{rep}" + ("" if code == codes[0][0] else f"_{code}")
                    rows, _ = benchlib.run_pipeline(model=model, run_dir=os.path.join(benchlib.REPO, args.out, tag),
                                                    name=name, code=tree, overrides=[
                        f"async_rl.alpha={alpha}", *item_overrides(item, alpha=alpha, code=tree),
                        f"trainer.total_steps={args.steps}", f"trainer.seed={seed}", *admission, *args.overrides])
                    rewards = [r["reward_mean"] for r in rows]
                    final = statistics.fmean(rewards[-args.last:])
                    finals[code][label].setdefault(seed, []).append(final)
                    diag[code][label].append(diagnostics(rows))
                    if code == codes[0][0]:
                        curves[label][f"{seed}/{rep}"] = rewards
                    benchlib.log(name, f"[{code}] {label} seed {seed} run {rep}: reward "
                                       f"{statistics.fmean(rewards[:5]):.3f} (first 5) → {final:.3f} (last {args.last})")
    if args.plot:
        plot(curves, os.path.join(benchlib.REPO, args.plot), alpha=args.alpha)
    per_code = {}
    for code, _ in codes:
        by_label = finals[code]
        stats = {label: summarize([f for runs_ in by.values() for f in runs_]) for label, by in by_label.items()}
        per_code[code] = {
            "final_reward": {label: {str(s): [round(f, 4) for f in v] for s, v in by.items()}
                             for label, by in by_label.items()},
            "stats": stats,
            "diagnostics": {label: {k: round(statistics.fmean(d[k] for d in ds if k in d), 5)
                                    for k in DIAGNOSTICS if any(k in d for d in ds)}
                            for label, ds in diag[code].items()},
        }
    this = per_code[codes[0][0]]
    means = {label: st["mean"] for label, st in this["stats"].items()}
    result: dict[str, Any] = {"steps": args.steps, "samples_per_run": args.steps * 128, "alpha": args.alpha,
                              "seeds": seeds, "repeats": args.repeats, "this": codes[0][0],
                              "final_reward_mean": means, **this}
    if "sync ppo" in means and means["sync ppo"] > 0 and len(means) > 1:
        best_label = max((lbl for lbl in means if not lbl.startswith("sync")), key=means.get)
        result["best_async"] = best_label
        result["ratio_best_async_to_sync"] = round(means[best_label] / means["sync ppo"], 3)
    if args.compare:
        # Paired by (seed, run): the two codes' runs of a pair share the warm model and ran back to back.
        rev = codes[1][0]
        diffs = {label: [a - b for seed in finals[rev][label] for a, b in
                         zip(finals[codes[0][0]][label][seed], finals[rev][label][seed])] for label in means}
        result["compare"] = {"rev": rev, **per_code[rev], "difference": {
            label: dict(zip(("this_minus_rev", "se_paired"), mean_se(d))) for label, d in diffs.items()}}
    result.update({"plot": args.plot or None, "load_avg_1m_before": load_before, "seconds": round(time.time() - t0, 1)})
    print(json.dumps(result, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
