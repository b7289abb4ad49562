"""Asynchronous (α = 2) vs synchronous (α = 0) RL on the same two cores: seconds per step, speedup.

    OMP_NUM_THREADS=1 python benchmarks/async_vs_sync.py [--steps 16] [--rounds 2] [--hidden-size 160]

Both modes run the product (`launch/pretrain_async_rl.py`, configs/quickstart_cpu.yaml) as two
processes on the 2-core CPU box: the Megatron trainer (with the rollout thread on rank 0) and one CPU
engine server. Same model, data and response-length distribution in both:

  model    a random-init Llama (--num-layers × --hidden-size) warmed up to answer countdown prompts
           with random letters of long-tail length (P(k) ∝ 1/k, 1 ≤ k ≤ --max-len, sampled per
           response; benchmarks/benchlib.py), so a batch's slowest response is ~4× its mean;
  policy   moves only slightly (lr --lr, default 1e-6) so both modes generate the same length
           distribution all run long (learning is benchmarks/learning.py's subject);
  engine   the quickstart's local engine server (64 KV blocks: ~21 requests run at once);
  batch    --prompts × --n samples per step, one micro-batch; ppo loss (speed, not learning, is measured:
           its α > 0 runs set loss.allow_uncorrected=true).

The model size is the knob that balances the two stages: with α = 0 a step is rollout + train + sync
run one after the other, with α = 2 it is bounded by the slower of rollout and train + sync. With the
stages balanced the ceiling is 2×; `ideal_speedup` is the ceiling for the measured α = 0 stage times
(sum / max). Modes are interleaved over --rounds (α=0, α=2, then α=2, α=0, ...) so that load from
other work on the machine hits both; the first --skip steps of each run are left out (start-up, the
first weight push, the α = 2 pipeline filling). Each run also records the cores its processes got
(from /proc: the trainer's main thread, its other threads = the rollout loop, the engine), and the
cores used by everything else on the machine: with other work taking a core, α = 2 cannot get the two
cores it overlaps on and the speedup collapses (docs/benchmarks.md).

The last line is a JSON object: per mode the steady-state s/step (`time_step`), samples/s, stage
times, engine idle fraction, cores and CPU seconds per step, and per round; `speedup` =
s/step(α=0) / s/step(α=2) of the means (paper: 2.24×), `speedup_median` of the per-round ratios,
`ideal_speedup`. --admissions eager,adaptive adds a mode per named `async_rl.admission` rule at α
(mode async_<rule>; --eager = --admissions eager), each with its speedup under
`async_<rule>.speedup_fields`: what the default rule (`tokens`) costs or saves in speed against
rollout always α batches ahead (eager) or the whole-batch adaptive rule.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

KEYS = ("time_step", "time_rollout_wait", "time_train", "time_sync", "engine_idle_frac", "samples_per_s",
        "tokens_per_s", "response_len_mean", "staleness_mean", "staleness_token_mean", "rollout_lookahead",
        "admission/sit_s", "admission/starved_s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16, help="train steps per run")
    p.add_argument("--skip", type=int, default=3, help="leading steps left out of the steady-state means")
    p.add_argument("--rounds", type=int, default=2, help="runs per mode, interleaved")
    p.add_argument("--alpha", type=int, default=2)
    p.add_argument("--eager", action="store_true", help="= --admissions eager")
    p.add_argument("--admissions", default="",
                   help="comma-separated async_rl.admission rules to also run at α (mode async_<rule>)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--micro-batch", type=int, default=0, help="0 = the whole batch in one micro-batch")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=160)
    p.add_argument("--max-len", type=int, default=32, help="longest response the warm-up teaches")
    p.add_argument("--loss", default="ppo")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--model-path", default="", help="use this HF model instead of building the long-tail one")
    p.add_argument("--out", default="runs/bench_async_vs_sync")
    benchlib.add_engine_device_args(p)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="more config overrides for both modes")
    args = p.parse_args()
    name = "async_vs_sync"
    model = args.model_path or benchlib.long_tail_model(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                                      max_len=args.max_len, name=name)
    batch = args.prompts * args.n
    overrides = [
        "data.task=countdown", "data.num_samples=4096", f"rollout.n_samples_per_prompt={args.n}",
        f"rollout.max_new_tokens={args.max_len + 8}", f"trainer.max_seq_len={args.max_len + 16}",
        f"trainer.global_batch_size={batch}", f"trainer.micro_batch_size={args.micro_batch or batch}",
        f"trainer.total_steps={args.steps}", f"loss.name={args.loss}", f"optimizer.lr={args.lr}",
        *[f"engines.server_args.{k}={v}" for k, v in benchlib.engine_device_server_args(args).items()],
        *args.overrides,
    ]
    opt_in = benchlib.uncorrected_opt_in(args.loss, args.alpha)
    order = [("sync", ["async_rl.alpha=0"]), ("async", [f"async_rl.alpha={args.alpha}", *opt_in])]
    extra_rules = [a for a in args.admissions.split(",") if a] + (["eager"] if args.eager else [])
    for rule in dict.fromkeys(extra_rules):
        order.append((f"async_{rule}", [f"async_rl.alpha={args.alpha}", f"async_rl.admission={rule}", *opt_in]))
    runs: dict[str, list[dict]] = {mode: [] for mode, _ in order}
    t0 = time.time()
    load_before = benchlib.uptime_load()
    for r in range(args.rounds):
        for mode, mode_overrides in (order if r % 2 == 0 else order[::-1]):
            run_dir = os.path.join(benchlib.REPO, args.out, f"{mode}_r{r}")
            rows, mon = benchlib.run_pipeline(model=model, run_dir=run_dir, name=name, monitor=True,
                                            overrides=[*overrides, *mode_overrides])
            stats = benchlib.steady(rows, skip=args.skip, keys=KEYS)
            stats.update(mon.cores(skip=args.skip) if mon else {})
            if "cores_engines" in stats:
                # CPU seconds per step of the rollout thread(s) in the trainer process (HTTP client, rewards,
                # scheduler) and engine CPU per generated token: who competes with whom for the 2 cores.
                stats["rollout_thread_cpu_s_per_step"] = stats["cores_trainer_other_threads"] * stats["time_step"]
                stats["trainer_main_cpu_s_per_step"] = stats["cores_trainer_main_thread"] * stats["time_step"]
                stats["engine_cpu_ms_per_token"] = 1e3 * stats["cores_engines"] / max(stats["tokens_per_s"], 1e-9)
            runs[mode].append(stats)
            benchlib.log(name, f"{mode} round {r}: {stats['time_step']:.3f} s/step (rollout wait "
                             f"{stats['time_rollout_wait']:.3f}, train {stats['time_train']:.3f}, sync "
                             f"{stats['time_sync']:.3f}, engine idle {stats['engine_idle_frac']:.2f})")

    keys = [*KEYS, "cores_trainer", "cores_trainer_main_thread", "cores_trainer_other_threads", "cores_engines",
            "cores_others", "trainer_main_cpu_s_per_step", "rollout_thread_cpu_s_per_step", "engine_cpu_ms_per_token"]
    result: dict = {"alpha": args.alpha, "batch": batch, "steps": args.steps, "skip": args.skip,
                    "rounds": args.rounds, "model": os.path.relpath(model, benchlib.REPO),
                    "num_layers": args.num_layers, "hidden_size": args.hidden_size, "max_len": args.max_len}
    for mode in runs:
        result[mode] = {k: benchlib.round_mean(runs[mode], k) for k in keys}
        result[mode]["samples_per_s"] = round(batch / result[mode]["time_step"], 2)  # of the mean step time
        result[mode]["per_round"] = [{k: round(s[k], 3) for k in ("time_step", "time_rollout_wait", "time_train",
                                                                  "time_sync", "engine_idle_frac", "cores_trainer",
                                                                  "cores_engines", "cores_others") if k in s}
                                     for s in runs[mode]]
    s, a = result["sync"], result["async"]
    stage_rollout, stage_train = s["time_rollout_wait"], s["time_train"] + s["time_sync"]
    result["ideal_speedup"] = round((stage_rollout + stage_train) / max(stage_rollout, stage_train), 3)
    result.update(benchlib.speedup_fields(runs["sync"], runs["async"]))
    for mode in runs:
        if mode.startswith("async_"):
            result[mode]["speedup_fields"] = benchlib.speedup_fields(runs["sync"], runs[mode])
    result["samples_per_s_ratio"] = round(a["samples_per_s"] / s["samples_per_s"], 3)
    result["load_avg_1m_before"] = load_before
    result["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
