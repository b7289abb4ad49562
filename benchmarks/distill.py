"""On-policy distillation vs RL on the quickstart task, same budget, synchronous and asynchronous.

    OMP_NUM_THREADS=1 python benchmarks/distill.py [--steps 30] [--seeds 0,1] [--alphas 0,2] [--teacher-steps 60]
    OMP_NUM_THREADS=1 python benchmarks/distill.py --topk 1,2,4,8 --runs rl,opd_only_top1,opd_only_top2,...

Teacher: the seed-0 sort4 warm model trained by RL (the quickstart config, --teacher-steps steps) to
a high reward; built once and cached under runs/bench_models. Student, per seed: that seed's fresh
format-only warm model (same tokenizer; reward at chance, ≈ 1/24). Per seed and α (async_rl.alpha),
runs of --steps steps of 16 prompts × 8 samples with the quickstart's loss (tis) and lr:

  rl          the task reward alone
  opd_only    distill.mode=only, distill.topk=0: the advantage is −λ · (log π_student − log π_teacher) per
              token (reward logged, unused); the student's logprob from the training forward
              (distill.student_logprobs=current); at α > 0 with distill.allow_sampled_estimate=true
  opd_reward  distill.mode=add, distill.topk=0: the task advantage plus that term
  opd_only_default  distill.mode=only and every other distill setting at its default (top-K)
  opd_only_behavior  (with --behavior) opd_only with the engine's logprob μ in k_t (student_logprobs=behavior)
  opd_only_topK, opd_reward_topK  (with --topk K,...) distill.topk=K: instead of k_t in the advantage, the
              reverse KL over the teacher's top-K tokens (+ the rest) at each position is a loss term

`final_reward` is the mean task reward of the last 5 steps; `steps_to_rl_final` is the first step at
which a run's 5-step running mean reaches that seed's and α's rl final reward (None if never): the aim
is OPD there in ≤ 1/3 of rl's steps. The last line is a JSON object; curves go to --plot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

SAMPLED = ["distill.topk=0"]  # the sampled-token estimate k_t alone (at α > 0 with allow_sampled_estimate)
RUNS = {"rl": [], "opd_only": ["distill.mode=only", *SAMPLED], "opd_reward": ["distill.mode=add", *SAMPLED],
        "opd_only_default": ["distill.mode=only"]}
BEHAVIOR = {"opd_only_behavior": ["distill.mode=only", "distill.student_logprobs=behavior", *SAMPLED]}


def teacher_model(steps: int, name: str) -> str:
    out = os.path.join(benchlib.MODELS_DIR, f"sort4_teacher_s0_{steps}")
    model = os.path.join(out, "final_hf")
    if os.path.isfile(os.path.join(model, "config.json")):
        return model
    benchlib.log(name, f"training the teacher {out} (once; cached)")
    rows, _ = benchlib.run_pipeline(model=benchlib.quickstart_warm_model(seed=0, name=name), run_dir=out, name=name,
                                    timeout_s=3600, overrides=[f"trainer.total_steps={steps}", "trainer.seed=0",
                                                               "checkpoint.save_hf_at_end=true"])
    benchlib.log(name, f"teacher: reward {statistics.fmean(r['reward_mean'] for r in rows[-5:]):.3f} (last 5 steps)")
    return model


def steps_to(rewards: list[float], target: float, window: int = 5) -> Optional[int]:
    for i in range(window, len(rewards) + 1):
        if statistics.fmean(rewards[i - window:i]) >= target:
            return i
    return None


def plot(curves: dict[str, dict[int, list[float]]], path: str) -> None:
    """One panel per α; `curves` is keyed "label α=A" → seed → rewards."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alphas = sorted({key.split("α=")[1] for key in curves}, key=int)
    fig, axes = plt.subplots(1, len(alphas), figsize=(5.2 * len(alphas), 3.8), dpi=100, squeeze=False)
    for ax, alpha in zip(axes[0], alphas):
        for key, by_seed in curves.items():
            if not key.endswith(f"α={alpha}") or not by_seed:
                continue
            runs = list(by_seed.values())
            steps = min(len(r) for r in runs)
            ax.plot(range(1, steps + 1), [statistics.fmean(r[i] for r in runs) for i in range(steps)],
                    label=key.split(" ")[0])
    benchlib.finish_reward_plot(fig, axes[0], path, titles=[f"sort4, tiny Llama on CPU, α = {a}" for a in alphas])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--alphas", default="0,2", help="async_rl.alpha values, each a full comparison")
    p.add_argument("--teacher-steps", type=int, default=60)
    p.add_argument("--coef", type=float, default=1.0, help="distill.coef (λ)")
    p.add_argument("--behavior", action="store_true", help="also opd_only with distill.student_logprobs=behavior")
    p.add_argument("--topk", default="", help="K[,K...]: also opd_only_topK and opd_reward_topK with distill.topk=K")
    p.add_argument("--runs", default="", help="comma-separated labels to run (default: all selected above)")
    p.add_argument("--plot", default="docs/img/distill_sort4.png", help="'' = no plot")
    p.add_argument("--out", default="runs/bench_distill")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="more config overrides for every run")
    args = p.parse_args()
    name = "distill"
    t0, load_before = time.time(), benchlib.uptime_load()
    teacher = teacher_model(args.teacher_steps, name)
    seeds = [int(s) for s in args.seeds.split(",")]
    alphas = [int(a) for a in args.alphas.split(",")]
    runs = {**RUNS, **(BEHAVIOR if args.behavior else {})}
    for k in [int(k) for k in args.topk.split(",") if k]:
        runs.update({f"opd_only_top{k}": ["distill.mode=only", f"distill.topk={k}"],
                     f"opd_reward_top{k}": ["distill.mode=add", f"distill.topk={k}"]})
    if args.runs:
        unknown = set(args.runs.split(",")) - set(runs)
        if unknown or "rl" not in args.runs.split(","):
            raise SystemExit(f"--runs: unknown {sorted(unknown)} or no rl (the reference); known: {sorted(runs)}")
        runs = {k: v for k, v in runs.items() if k in args.runs.split(",")}
    keys = [f"{label} α={alpha}" for alpha in alphas for label in runs]
    curves: dict[str, dict[int, list[float]]] = {key: {} for key in keys}
    extra: dict[str, dict[int, dict[str, Any]]] = {key: {} for key in keys}
    ours = [o for o in args.overrides if o.startswith("distill.")]  # only where a teacher runs
    for seed in seeds:
        student = benchlib.quickstart_warm_model(seed=seed, name=name)
        for alpha in alphas:
            for label, overrides in runs.items():
                key = f"{label} α={alpha}"
                distill = [] if not overrides else [f"distill.teacher={teacher}", f"distill.coef={args.coef}",
                                                    f"distill.base_port={benchlib.free_ports(1)}", *overrides, *ours]
                if "distill.topk=0" in distill and alpha > 0:  # measuring it is the point
                    distill.append("distill.allow_sampled_estimate=true")
                rows, _ = benchlib.run_pipeline(
                    model=student, run_dir=os.path.join(benchlib.REPO, args.out, f"{label}_a{alpha}_s{seed}"), name=name,
                    overrides=[f"trainer.total_steps={args.steps}", f"trainer.seed={seed}", f"async_rl.alpha={alpha}",
                               *distill, *(o for o in args.overrides if not o.startswith("distill."))])
                curves[key][seed] = [r["reward_mean"] for r in rows]
                kl = [r["distill/reverse_kl"] for r in rows if r.get("distill/reverse_kl") is not None]
                top = [r["train/distill/topk_reverse_kl"] for r in rows if r.get("train/distill/topk_reverse_kl") is not None]
                extra[key][seed] = {
                    "reverse_kl_first": kl[0] if kl else None, "reverse_kl_last": kl[-1] if kl else None,
                    "topk_kl_first": top[0] if top else None, "topk_kl_last": top[-1] if top else None,
                    "response_len_min": min(r["response_len_mean"] for r in rows),
                    "staleness_token_mean": statistics.fmean(r["staleness_token_mean"] or 0.0 for r in rows),
                    "time_step_median": statistics.median(r["time_step"] for r in rows)}
                benchlib.log(name, f"{key} seed {seed}: reward {statistics.fmean(curves[key][seed][-5:]):.3f} (last 5)")
    finals = {key: {s: round(statistics.fmean(c[-5:]), 4) for s, c in by.items()} for key, by in curves.items()}
    result: dict[str, Any] = {"steps": args.steps, "seeds": seeds, "alphas": alphas, "teacher": teacher,
                              "coef": args.coef, "topk": args.topk, "final_reward": finals,
                              "final_reward_mean": {k: round(statistics.fmean(v.values()), 4) for k, v in finals.items()}}
    reach = {key: {s: steps_to(curves[key][s], finals[f"rl α={key.split('α=')[1]}"][s]) for s in seeds} for key in keys}
    result["steps_to_rl_final"] = reach
    result["ratio_steps_to_rl"] = {key: [None if reach[key][s] is None else round(reach[key][s] / args.steps, 3)
                                         for s in seeds] for key in keys if not key.startswith("rl ")}
    result["runs"] = extra
    if args.plot:
        plot(curves, os.path.join(benchlib.REPO, args.plot))
    result.update({"plot": args.plot or None, "load_avg_1m_before": load_before, "seconds": round(time.time() - t0, 1)})
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
