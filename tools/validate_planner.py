"""Planner validation: predict the CPU benchmarks from measured inputs, compare with what they measured.

    python tools/validate_planner.py                      # ~1 min on the 2-core box; last line JSON
    python tools/validate_planner.py --runs runs          # measured outputs from runs/bench_*/*/metrics.jsonl
    python tools/validate_planner.py --paper-shape        # + speedup vs GPU count and vs length spread (7B, H100)

For each benchmark the planner (megatron_flash/planner/) gets the benchmark's own settings (batch,
group size, engines, running requests per engine, α, redundancy, replication on/off/chunk, dynamic-filter
keep rate, env latency and turns) and measured costs, and predicts seconds per step (env async: the
makespan); the benchmarks' outputs are never fitted. Three cost sets:

  alone        nothing fitted: the local engine's decode step vs running sequences measured alone
               (benchmarks/engine_step_cost.py, 2026-11-22, quiet box), its cost per request measured in
               a closed loop (requests arriving one at a time, as a rollout sends them; 1.5 ms), and the
               rollout client's CPU per request (1.2 ms, /proc, async_vs_sync) as a serial client cost.
  loaded 2026-11-22
               the same, but the decode-step curve recorded on 2026-11-22 at 08:40 (3.2 ms @1, 4.0 @4,
               7.2 @16, 18 @64; taken while other jobs loaded the box, model not recorded).
  stage time   `alone` plus ONE number per machine taken from a measured stage time: the engine seconds
               each request costs in the product's request path, solved so that the simulated rollout
               stage of async_vs_sync's synchronous (α = 0) run equals the measured one (0.846 s on the
               2-core box, 0.870 s on the 16-core box). Every other row on that machine is a prediction.

Same-hour rows (2026-11-24): async_vs_sync, queue_scheduling, prompt_replication and env_async re-run on the 2-core box
within minutes of fresh decode-step curves and closed-loop request costs (engine_step_cost.py) for both
models; `alone` there uses those and the run's own rollout-thread CPU per request, nothing fitted. They are
summarised apart: older rows compare runs with engine curves taken hours or days away, and the CPU
engine's curve drifts with box, hour and load.

Measured numbers: constants below, each with where it comes from (docs/benchmarks.md); with `--runs DIR`
the ones that have run directories (DIR/bench_async_vs_sync, bench_queue_s3, bench_pr_s3_8, bench_pr_s3:
metrics.jsonl per run, not in git) are recomputed from them (the benchmarks' steady-state means).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_flash import planner  # noqa: E402

# ---- measured inputs ----------------------------------------------------------------------------------
# local engine server, 1 thread, quiet 2-core box (2026-11-22): seconds of one decode step vs sequences running,
# all k requests sent together. `OMP_NUM_THREADS=1 python benchmarks/engine_step_cost.py` (2 layers × 64: the
# model of queue_scheduling / prompt_replication / env_async) and `... --num-layers 4 --hidden-size 160`
# (async_vs_sync's model).
STEP_L2_H64 = [(1, 0.000944), (2, 0.00109), (4, 0.001131), (8, 0.001552), (16, 0.001963), (32, 0.003629),
               (64, 0.007761)]
STEP_L4_H160 = [(1, 0.001416), (4, 0.001987), (8, 0.002813), (16, 0.004081), (32, 0.008593)]
# The same on the 16-core GPU box (GPU hidden, uncontended; 2026-11-22, docs/benchmarks.md "GPU box"), 2 × 64 model.
STEP16_L2_H64 = [(1, 0.0022), (4, 0.0029), (8, 0.0039), (16, 0.0050), (64, 0.0093)]
# The same 2 × 64 curve re-measured on the 2-core box on 2026-11-24 (load ~1, before f55fc73), next to the
# replication run "rep8_2026_11_24_early" below: `OMP_NUM_THREADS=1 python benchmarks/engine_step_cost.py
# --k 1,2,4,8,16,32,64`.
STEP_2026_11_24_EARLY_L2_H64 = [(1, 0.00138), (2, 0.00156), (4, 0.00182), (8, 0.00239), (16, 0.00241),
                                (32, 0.00398), (64, 0.00798)]
# The 4 × 160 curve re-measured on the 2-core box on 2026-11-24 14:21 (load 0.5), minutes after the
# "avs2_2026_11_24" run below and after the local engine server's cheaper request path (f55fc73): `OMP_NUM_THREADS=1 python
# benchmarks/engine_step_cost.py --num-layers 4 --hidden-size 160 --k 1,4,8,16,32 --loop-k 8,21 --short 4
# --long 24`; closed loop at 21 running (the run's cap): 1.22 ms engine seconds per request.
STEP_2026_11_24_L4_H160 = [(1, 0.001917), (4, 0.002328), (8, 0.002784), (16, 0.00352), (32, 0.004992)]
ENGINE_PER_REQUEST_2026_11_24 = 0.00122
# That run's rollout thread: 0.085 CPU-s per 128-sample step at α = 0 (/proc) = 0.66 ms per request.
# The 2 × 64 curve on the same day, 14:23 (load 0.5), just before the "rep8_2026_11_24" and "queue_2026_11_24"
# runs:
# `OMP_NUM_THREADS=1 python benchmarks/engine_step_cost.py --k 1,2,4,8,16,32,64 --loop-k 4,8 --loop-n 1,8
# --short 4 --long 24`. Re-measured at 14:26, after them: within 5 % except k = 8 (2.57 ms, one outlier).
# Closed loop (n = 1), before / after: 4 running 1.16 / 1.08 ms per request, 8 running 0.92 / 0.82 ms.
STEP_2026_11_24_L2_H64 = [(1, 0.00117), (2, 0.0013), (4, 0.00146), (8, 0.00164), (16, 0.00205), (32, 0.00312),
                          (64, 0.00509)]
ENGINE_PER_REQUEST_2026_11_24_CAP4, ENGINE_PER_REQUEST_2026_11_24_CAP8 = 0.00112, 0.00087
# Again at 14:38, seconds after the "env*_2026_11_24" runs: `... --k 1,2,4,8,16,32,64 --loop-k 16,64 --short 4
# --long 24`;
# closed loop at 64 running (env_async's 64 instances on one engine): 1.10 ms per request.
STEP_2026_11_24_ENV_L2_H64 = [(1, 0.00128), (2, 0.00137), (4, 0.00144), (8, 0.00179), (16, 0.00214),
                              (32, 0.00329), (64, 0.00561)]
ENGINE_PER_REQUEST_2026_11_24_CAP64 = 0.00110
# Prefill: the same closed loop with 100-token vs 2-token prompts, 14:52, 2 × 64 model, server as env_async's
# (512 tokens per forward step): `OMP_NUM_THREADS=1 python benchmarks/engine_step_cost.py --skip-batch
# --loop-k 16,64 --loop-prompt-len 2,100 --max-batch-tokens 512 --short 4 --long 24`. At 16 running: 2.19 vs
# 0.55 ms per request → 16.7 µs per prefilled token (decode step 3.16 vs 2.23 ms: longer context). At 64 the
# split is different (2.12 vs 1.28 ms per request, 8.6 µs per token, but the decode step 19.9 vs 3.05 ms):
# the 16-running figure is used. The local engine server has no prefix cache: each turn of an episode prefills the
# whole conversation again.
PREFILL_TOKEN_ENGINE_S = 16.7e-6
# env_async's conversation (the tiny tokenizer's chat template, ChatTokens): 18 prompt tokens; each env turn
# appends the end token and an 18-token observation turn.
ENV_PROMPT_TOKENS, ENV_TURN_TOKENS = 18, 19
CLIENT_CPU_PER_REQUEST_2026_11_24 = 0.00066
# The decode-step figures recorded on the loaded box (benchmarks/queue_scheduling.py docstring, docs/benchmarks.md
# "What limits each speedup"): measured at 08:40 on 2026-11-22 while other jobs kept the load at 4-9.
STEP_LOADED_2026_11_22 = [(1, 0.0032), (4, 0.0040), (16, 0.0072), (64, 0.018)]
# Engine seconds per request when requests arrive one at a time (closed loop of k workers, each sending its
# next request when its last returns): `benchmarks/engine_step_cost.py --loop-k 4,8,16,21,32 --short 4
# --long 24` (2026-11-22, load 1.6-2.0 from other work, engine busy 0.93-0.97): 2 × 64 model 1.5-2.1 ms
# (k = 4..32), 4 × 160 model 0.9-1.4 ms. One value for both.
ENGINE_PER_REQUEST_S = 0.0015
# Rollout client (the trainer process's asyncio loop: scheduler, proxy, HTTP, logprobs, rewards): 0.15 CPU-s
# per 128-sample step = 1.2 ms per request, from /proc in async_vs_sync (docs/benchmarks.md, "What limits
# each speedup here"). Modelled as a serial server in front of the engines.
CLIENT_CPU_PER_REQUEST_S = 0.0012

# The local engine on CUDA (H200, bf16, transformers CB; 2026-11-26 18:53, docs/benchmarks.md "H200,
# 2026-11-26"): `benchmarks/engine_step_cost.py --device cuda --dtype bfloat16 --k 1,4,8,16,32,64 --short 8
# --long 40 --repeats 3`, the 2 × 64 model, while the quickstart test used the same GPU. k = 32 and 64 came out
# as noise (46.8 ms and negative) and are left out: beyond 16 the curve is extrapolated. Per request at 4
# running: 0.94 ms.
STEP_H200_L2_H64 = [(1, 0.00307), (4, 0.00345), (8, 0.00339), (16, 0.00525)]
ENGINE_PER_REQUEST_H200 = 0.00094

# Response lengths (tokens incl. the end token) the long-tail model generated: 1280 responses of
# runs/bench_queue_s3/queue_r0/groups.jsonl (2026-11-22); 40 = max_new_tokens (cut). Mean 11.1; the target
# P(k) ∝ 1/k, k ≤ 32 (planner.inv_k_lengths(32)) has mean 7.9: the model learned it loosely.
LENGTH_HIST = {1: 13, 2: 260, 3: 145, 4: 70, 5: 68, 6: 68, 7: 45, 8: 41, 9: 43, 10: 35, 11: 30, 12: 35, 13: 35,
               14: 27, 15: 17, 16: 27, 17: 21, 18: 35, 19: 18, 20: 25, 21: 18, 22: 18, 23: 15, 24: 12, 25: 11,
               26: 10, 27: 11, 28: 13, 29: 9, 30: 10, 31: 8, 32: 5, 33: 4, 34: 2, 35: 7, 36: 7, 37: 5, 38: 2,
               39: 3, 40: 52}

# Dynamic filter of queue_scheduling.py: pass rate per prompt uniform over {0, .25, .5, .75, 1}; a group of 8
# is kept unless all its rewards are equal: keep = mean over rates of 1 - p^8 - (1-p)^8 = 0.558.
PASS_RATES = (0.0, 0.25, 0.5, 0.75, 1.0)
KEEP_PROB = statistics.fmean(1 - p ** 8 - (1 - p) ** 8 for p in PASS_RATES)

# ---- measured outputs (and stage times) -----------------------------------------------------------------
# Each: steady-state means; `rounds` = per-round values (the spread between rounds is the measurement noise);
# `cmd` and `tag` = the command that measured it and what its printed benchmark name adds.
MEASURED: dict[str, dict] = {
    # 2-core box, quiet (2026-11-22 08:42; runs/bench_async_vs_sync, steps 3-15 of 3 rounds per mode):
    # sync = rollout 0.846 + train 0.803 + sync 0.102; async train 0.888 (the rollout thread shares its core).
    "avs2": {"cmd": "python benchmarks/async_vs_sync.py --rounds 3", "tag": ", 2-core box",
             "sync": 1.751, "sync_rounds": [1.766, 1.719, 1.768], "async": 0.991, "async_rounds": [0.954, 1.084, 0.934],
             "rollout": 0.846, "train": 0.803, "sync_s": 0.102, "train_async": 0.888, "sync_s_async": 0.102,
             "response_len_mean": 10.15, "runs": "bench_async_vs_sync", "skip": 3},
    # 2-core box, 2026-11-24 14:18, quiet (load 0.03), after f55fc73: `OMP_NUM_THREADS=1 python
    # benchmarks/async_vs_sync.py --rounds 3` (docs/benchmarks.md, issue-6 table, the re-run row).
    "avs2_2026_11_24": {"cmd": "OMP_NUM_THREADS=1 python benchmarks/async_vs_sync.py --rounds 3 (2026-11-24)",
                        "tag": ", 2-core box, 2026-11-24 curve",
                        "sync": 1.120, "sync_rounds": [1.131, 1.117, 1.111], "async": 0.7345,
                        "async_rounds": [0.729, 0.732, 0.743], "rollout": 0.4385, "train": 0.613, "sync_s": 0.0684,
                        "train_async": 0.6656, "sync_s_async": 0.0687, "response_len_mean": 10.18},
    # 16-core GPU box, GPU hidden, uncontended (2026-11-22, docs "GPU box"): 2 rounds per mode.
    "avs16": {"cmd": "CUDA_VISIBLE_DEVICES= python benchmarks/async_vs_sync.py --rounds 2 (GPU box)",
              "tag": ", 16-core box",
              "sync": 1.876, "sync_rounds": [1.903, 1.849], "async": 1.012, "async_rounds": [1.010, 1.014],
              "rollout": 0.870, "train": 0.902, "sync_s": 0.104, "train_async": 0.902, "sync_s_async": 0.109,
              "response_len_mean": 10.15},
    # queue_scheduling.py defaults, 2026-11-22 09:57, quiet (runs/bench_queue_s3, steps 2-9 of 2 rounds); the
    # batch baseline writes no metrics.jsonl (numbers from the benchmark's JSON, docs/benchmarks.md).
    "queue": {"cmd": "python benchmarks/queue_scheduling.py --out runs/bench_queue_s3", "tag": "",
              "batch": 0.978, "batch_rounds": [], "queue": 0.983, "queue_rounds": [1.067, 0.899],
              "no_extra": 0.918, "no_extra_rounds": [0.925, 0.911], "runs": "bench_queue_s3", "skip": 2,
              "dirs": {"queue": "queue", "no_extra": "queue_no_extra"}},
    # prompt_replication.py --chunk 4 --rounds 3 (8 slots per engine), 2026-11-22 10:27, load 0.6-1.7
    # (runs/bench_pr_s3_8, steps 3-9).
    "rep8": {"cmd": "python benchmarks/prompt_replication.py --chunk 4 --rounds 3", "tag": "",
             "off": 0.454, "off_rounds": [0.429, 0.548, 0.384], "on": 0.376, "on_rounds": [0.404, 0.367, 0.358],
             "chunk4": 0.391, "chunk4_rounds": [0.429, 0.401, 0.343], "runs": "bench_pr_s3_8", "skip": 3,
             "dirs": {"off": "off", "on": "on", "chunk4": "chunked"}},
    # ... --max-inflight 16 --chunk 4 (2 rounds), 2026-11-22 10:31 (runs/bench_pr_s3).
    "rep16": {"cmd": "python benchmarks/prompt_replication.py --max-inflight 16 --chunk 4", "tag": "",
              "off": 0.287, "off_rounds": [0.267, 0.308], "on": 0.342, "on_rounds": [0.268, 0.416],
              "chunk4": 0.256, "chunk4_rounds": [0.259, 0.253], "runs": "bench_pr_s3", "skip": 3,
              "dirs": {"off": "off", "on": "on", "chunk4": "chunked"}},
    # The same with 8 slots (defaults), 1 round, on the 16-core GPU box (GPU hidden, uncontended; 2026-11-22,
    # docs/benchmarks.md "GPU box"): `CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 python
    # benchmarks/prompt_replication.py --rounds 1 --chunk 4`.
    "rep8_16core": {"tag": ", 16-core box",
                    "cmd": "CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 python benchmarks/prompt_replication.py --rounds 1 --chunk 4 (GPU box)",
                    "off": 0.511, "off_rounds": [0.511], "on": 0.399, "on_rounds": [0.399],
                    "chunk4": 0.556, "chunk4_rounds": [0.556]},
    # The same with 8 slots, 2 rounds, 2-core box, 2026-11-24 (load 0.85), minutes after STEP_2026_11_24_EARLY_L2_H64:
    # `OMP_NUM_THREADS=1 python benchmarks/prompt_replication.py --chunk 4 --rounds 2`.
    "rep8_2026_11_24_early": {"tag": ", 2-core box, earlier 2026-11-24 curve",
                              "cmd": "OMP_NUM_THREADS=1 python benchmarks/prompt_replication.py --chunk 4 --rounds 2 "
                                     "(2026-11-24)",
                              "off": 0.496, "off_rounds": [0.491, 0.501], "on": 0.460, "on_rounds": [0.497, 0.423],
                              "chunk4": 0.502, "chunk4_rounds": [0.448, 0.557]},
    # The same two benchmarks on 2026-11-24, 2-core box, minutes after STEP_2026_11_24_L2_H64 (load 0.7-2.4: the
    # two engines and the trainer): `OMP_NUM_THREADS=1 python benchmarks/prompt_replication.py --chunk 4 --rounds 2
    # --out runs/bench_pr_s7` (14:24) and `OMP_NUM_THREADS=1 python benchmarks/queue_scheduling.py --out
    # runs/bench_queue_s7` (14:25).
    "rep8_2026_11_24": {"tag": ", 2026-11-24 curve",
                        "cmd": "OMP_NUM_THREADS=1 python benchmarks/prompt_replication.py --chunk 4 --rounds 2 "
                               "--out runs/bench_pr_s7",
                        "off": 0.3492, "off_rounds": [0.366, 0.333], "on": 0.2466, "on_rounds": [0.237, 0.256],
                        "chunk4": 0.3216, "chunk4_rounds": [0.314, 0.330]},
    "queue_2026_11_24": {"cmd": "OMP_NUM_THREADS=1 python benchmarks/queue_scheduling.py --out runs/bench_queue_s7 "
                                "(2026-11-24)",
                         "tag": ", 2026-11-24 curve",
                         "batch": 0.7878, "batch_rounds": [0.813, 0.763], "queue": 0.7344,
                         "queue_rounds": [0.743, 0.726], "no_extra": 0.7086, "no_extra_rounds": [0.707, 0.710]},
    # queue_scheduling.py with its two engines on the H200 (bf16), 1 round, 2026-11-26 18:55-18:58, beside the
    # contract tier on the same GPU: `python benchmarks/queue_scheduling.py --engine-device cuda --rounds 1`.
    "queue_h200": {"cmd": "python benchmarks/queue_scheduling.py --engine-device cuda --rounds 1 (H200)",
                   "tag": ", engines on an H200, their standalone curve",
                   "batch": 3.0795, "batch_rounds": [3.080], "queue": 3.0718, "queue_rounds": [3.072],
                   "no_extra": 3.4549, "no_extra_rounds": [3.455]},
    # env_async.py on 2026-11-24 14:33-14:38, 2-core box, quiet (load 0.4-0.7): `OMP_NUM_THREADS=1 python
    # benchmarks/env_async.py --mu-ms 100,300 --repeats 3 --redundancy 0`, medians of 3.
    "env300_2026_11_24": {"cmd": "OMP_NUM_THREADS=1 python benchmarks/env_async.py --mu-ms 100,300 --repeats 3 "
                                 "--redundancy 0",
                          "tag": ", 2026-11-24 curve",
                          "batch": 39.4, "batch_rounds": [39.64, 39.27, 39.4], "async": 15.57,
                          "async_rounds": [15.53, 15.57, 15.69]},
    "env100_2026_11_24": {"cmd": "OMP_NUM_THREADS=1 python benchmarks/env_async.py --mu-ms 100,300 --repeats 3 "
                                 "--redundancy 0",
                          "tag": ", 2026-11-24 curve",
                          "batch": 18.23, "batch_rounds": [18.11, 18.26, 18.23], "async": 7.46,
                          "async_rounds": [7.23, 7.46, 7.57]},
    # env_async.py, 64 env instances, medians of 3 interleaved runs, quiet box (docs "Env-level async").
    "env300": {"cmd": "python benchmarks/env_async.py --mu-ms 300 --repeats 3", "tag": "", "batch": 45.1, "async": 16.9},
    "env100": {"cmd": "python benchmarks/env_async.py --mu-ms 100 --repeats 3", "tag": "", "batch": 25.3, "async": 13.6},
}


def read_runs(root: str) -> list[str]:
    """Replace MEASURED numbers by the steady-state means of the run directories under `root` (where present)."""
    used = []
    for key, m in MEASURED.items():
        if "runs" not in m or not os.path.isdir(os.path.join(root, m["runs"])):
            continue
        base = os.path.join(root, m["runs"])
        dirs = m.get("dirs") or {"sync": "sync", "async": "async"}
        for mode, prefix in dirs.items():
            per_round = []
            for sub in sorted(os.listdir(base)):
                path = os.path.join(base, sub, "metrics.jsonl")
                if sub.rsplit("_r", 1)[0] != prefix or not os.path.isfile(path):
                    continue
                with open(path) as f:
                    rows = [json.loads(x) for x in f if x.strip()][m["skip"]:]
                if rows:
                    per_round.append({k: statistics.fmean(r[k] for r in rows if r.get(k) is not None)
                                      for k in ("time_step", "time_rollout_wait", "time_train", "time_sync",
                                                "response_len_mean") if any(r.get(k) is not None for r in rows)})
            if not per_round:
                continue
            mean = {k: statistics.fmean(r[k] for r in per_round) for k in per_round[0]}
            m[mode], m[f"{mode}_rounds"] = mean["time_step"], [r["time_step"] for r in per_round]
            if key == "avs2" and mode == "sync":
                m.update(rollout=mean["time_rollout_wait"], train=mean["time_train"], sync_s=mean["time_sync"],
                         response_len_mean=mean["response_len_mean"])
            if key == "avs2" and mode == "async":
                m.update(train_async=mean["time_train"], sync_s_async=mean["time_sync"])
            used.append(f"{m['runs']}/{prefix}_r* ({len(per_round)} runs)")
    return used


# ---- planner inputs --------------------------------------------------------------------------------------

LENGTHS = {"mode": "measured"}  # --lengths: "measured" (LENGTH_HIST) or "inv_k" (the target P(k) ∝ 1/k, k ≤ 32)


def hist_lengths(mean: float = 0.0) -> Callable[[random.Random], int]:
    """Sampler of the measured histogram; with `mean`, every draw scaled to that mean (stochastic rounding).
    With --lengths inv_k: planner.inv_k_lengths(32), the distribution the warm-up taught, whatever `mean`."""
    if LENGTHS["mode"] == "inv_k":
        return planner.inv_k_lengths(32)
    data = [k for k, c in LENGTH_HIST.items() for _ in range(c)]
    f = mean / statistics.fmean(data) if mean else 1.0

    def draw(rng: random.Random) -> int:
        x = data[rng.randrange(len(data))] * f
        return max(1, int(x) + (rng.random() < x - int(x)))
    return draw


class CostSet:
    def __init__(self, name: str, *, step_small=STEP_L2_H64, step_large=STEP_L4_H160, request_s=ENGINE_PER_REQUEST_S,
                 client_s=CLIENT_CPU_PER_REQUEST_S) -> None:
        self.name, self.request_s, self.client_s = name, request_s, client_s
        self.step = {"L2H64": planner.measured_decode(step_small), "L4H160": planner.measured_decode(step_large)}

    def costs(self, model: str, *, cap: int, train: float = 0.0, sync: float = 0.0,
              request_s: float | None = None, prefill_token_s: float = 0.0) -> planner.Costs:
        """`prefill_token_s`: engine seconds per prefilled token, for multi-turn rows (the other benchmarks'
        prompts are as short as the one the request cost was measured with); the local engine server re-prefills."""
        return planner.Costs(decode_step=self.step[model], engine_cap=cap, prefill_s=0.0,
                             train_s=lambda g, tokens: train, sync_s=sync,
                             request_engine_s=self.request_s if request_s is None else request_s,
                             client_per_request_s=self.client_s, prefill_token_engine_s=prefill_token_s,
                             prefix_cache=False)


def sim(work: planner.Workload, costs: planner.Costs, *, seeds: int, steps: int, **kw) -> planner.Result:
    """Mean over seeds of the steady-state seconds per step and of the makespan."""
    runs = [planner.simulate(work=work, costs=costs, train_gpus=1, num_steps=steps, seed=s, **kw) for s in range(seeds)]
    out = runs[0]
    out.sec_per_step = statistics.fmean(r.sec_per_step for r in runs)
    out.total_s = statistics.fmean(r.total_s for r in runs)
    return out


# ---- benchmarks ------------------------------------------------------------------------------------------

def avs_work(m: dict) -> planner.Workload:
    """benchmarks/async_vs_sync.py: 16 prompts × 8 per step, countdown prompts, lengths of the long-tail model
    (its runs' mean response length; the histogram is the 2 × 64 model's)."""
    return planner.Workload(batch_size=128, group_size=8, prompt_len=8, lengths=hist_lengths(m["response_len_mean"]))


AVS_CAP = 21  # one engine; configs/quickstart_cpu.yaml's 64 KV blocks of 16 tokens hold 21 requests of ≤ 48 tokens


def fit_request_cost(m: dict, cs: CostSet, *, seeds: int, steps: int) -> float:
    """Engine seconds per request that make the simulated α = 0 rollout stage of async_vs_sync equal the
    measured one (secant on a nearly linear function)."""
    work = avs_work(m)

    def rollout(p: float) -> float:
        c = cs.costs("L4H160", cap=AVS_CAP, train=m["train"], sync=m["sync_s"], request_s=p)
        return sim(work, c, alpha=0, num_engines=1, seeds=seeds, steps=steps).sec_per_step - m["train"] - m["sync_s"]

    p0, p1 = 0.0, 0.004
    r0, r1 = rollout(p0), rollout(p1)
    for _ in range(4):
        if abs(r1 - r0) < 1e-12:
            break
        p0, p1, r0 = p1, max(0.0, p1 + (m["rollout"] - r1) * (p1 - p0) / (r1 - r0)), r1
        r1 = rollout(p1)
        if abs(r1 - m["rollout"]) < 1e-3 * m["rollout"]:
            break
    return p1


def row(bench: str, what: str, command: str, measured: float, rounds: list[float], preds: dict[str, float],
        fit: tuple[str, ...] = ()) -> dict:
    """One comparison; `fit` names the cost sets for which this measurement was an input (not a prediction)."""
    return {"benchmark": bench, "what": what, "command": command, "measured": round(measured, 4),
            "rounds": [round(x, 3) for x in rounds], "fit": [c for c in fit if c in preds],
            "predicted": {k: round(v, 4) for k, v in preds.items()},
            "error": {k: round((v - measured) / measured, 4) for k, v in preds.items()}}


def async_vs_sync(key: str, sets: list[CostSet], req: dict[str, float], *, seeds: int, steps: int) -> list[dict]:
    """One engine (21 running), α = 2 vs α = 0, measured train and sync seconds per step."""
    m = MEASURED[key]
    cmd = m["cmd"]
    work = avs_work(m)
    s0, a2, a2b = {}, {}, {}
    for cs in sets:
        p = req.get(cs.name)
        c0 = cs.costs("L4H160", cap=AVS_CAP, train=m["train"], sync=m["sync_s"], request_s=p)
        c2 = cs.costs("L4H160", cap=AVS_CAP, train=m["train_async"], sync=m["sync_s_async"], request_s=p)
        kw = dict(num_engines=1, seeds=seeds, steps=steps)
        s0[cs.name] = sim(work, c0, alpha=0, **kw).sec_per_step
        a2[cs.name] = sim(work, c0, alpha=2, **kw).sec_per_step
        a2b[cs.name] = sim(work, c2, alpha=2, **kw).sec_per_step
    bench = "async vs sync" + m["tag"]
    return [row(bench, "sync (α=0) s/step", cmd, m["sync"], m["sync_rounds"], s0, fit=("stage time",)),
            row(bench, "async (α=2) s/step, α=0 stage times", cmd, m["async"], m["async_rounds"], a2),
            row(bench, "async (α=2) s/step, α=2 run's train/sync times", cmd, m["async"], m["async_rounds"], a2b),
            row(bench, "speedup", cmd, m["sync"] / m["async"], [], {k: s0[k] / a2b[k] for k in s0})]


def queue_scheduling(sets: list[CostSet], req: dict[str, float], *, seeds: int, steps: int,
                     key: str = "queue") -> list[dict]:
    """queue_scheduling.py defaults: 16 kept groups × 8 per step, 2 engines × 4 running, α = 0, rollout only,
    nonzero_std filter (keep 0.558); batch = rounds of every missing group, queue = the product with
    extra_prompts=4, no_extra = extra_prompts=0."""
    m = MEASURED[key]
    work = planner.Workload(batch_size=128, group_size=8, prompt_len=2, lengths=hist_lengths(), keep_prob=KEEP_PROB)
    out: dict[str, dict[str, float]] = {"batch": {}, "queue": {}, "no_extra": {}}
    for cs in sets:
        c = cs.costs("L2H64", cap=4, train=0.004, request_s=req.get(cs.name))
        kw = dict(num_engines=2, alpha=0, seeds=seeds, steps=steps)
        out["batch"][cs.name] = sim(work, c, scheduling="batch", **kw).sec_per_step
        out["queue"][cs.name] = sim(work, c, extra_groups=4, **kw).sec_per_step
        out["no_extra"][cs.name] = sim(work, c, **kw).sec_per_step
    cmd, b = m["cmd"], "queue scheduling (2 engines × 4 running, α=0, filter)" + m["tag"]
    return [row(b, "batch s/step", cmd, m["batch"], m["batch_rounds"], out["batch"]),
            row(b, "queue + 4 redundant s/step", cmd, m["queue"], m["queue_rounds"], out["queue"]),
            row(b, "queue, no redundancy s/step", cmd, m["no_extra"], m["no_extra_rounds"], out["no_extra"]),
            row(b, "speedup queue + redundant", cmd, m["batch"] / m["queue"], [],
                {k: out["batch"][k] / out["queue"][k] for k in out["batch"]}),
            row(b, "speedup queue, no redundancy", cmd, m["batch"] / m["no_extra"], [],
                {k: out["batch"][k] / out["no_extra"][k] for k in out["batch"]})]


def prompt_replication(slots: int, sets: list[CostSet], req: dict[str, float], *, seeds: int, steps: int,
                       key: str = "") -> list[dict]:
    """prompt_replication.py: 16 × 8 per step, 2 engines × `slots` running, α = 2, rollout only; off = one
    request of n = 8 per group (its members decode and end individually, the request holds 8 slots until
    the last ends), on = 8 requests, chunk 4 = 2 requests of 4."""
    key = key or f"rep{slots}"
    m = MEASURED[key]
    work = planner.Workload(batch_size=128, group_size=8, prompt_len=2, lengths=hist_lengths())
    out: dict[str, dict[str, float]] = {"off": {}, "on": {}, "chunk4": {}}
    for cs in sets:
        c = cs.costs("L2H64", cap=slots, train=0.006, request_s=req.get(cs.name))
        kw = dict(num_engines=2, alpha=2, seeds=seeds, steps=steps)
        out["off"][cs.name] = sim(work, c, prompt_replication=False, **kw).sec_per_step
        out["on"][cs.name] = sim(work, c, **kw).sec_per_step
        out["chunk4"][cs.name] = sim(work, c, replication_chunk=4, **kw).sec_per_step
    cmd, b = m["cmd"], f"prompt replication ({slots} slots × 2 engines, α=2)" + m["tag"]
    rows = [row(b, f"{mode} s/step", cmd, m[mode], m[f"{mode}_rounds"], out[mode]) for mode in ("off", "on", "chunk4")]
    for mode in ("on", "chunk4"):
        rows.append(row(b, f"speedup {mode} vs off", cmd, m["off"] / m[mode], [],
                        {k: out["off"][k] / out[mode][k] for k in out["off"]}))
    return rows


def env_async(sets: list[CostSet], req: dict[str, float], *, seeds: int, suffix: str = "") -> list[dict]:
    """env_async.py defaults: 64 groups of 4 episodes, 16 groups (64 env instances) at a time, 8 turns of 4
    tokens, env latency normal(μ, σ = μ) clipped at 0, one engine; batch = lockstep turns of 16 groups,
    async = each episode its own task, a group starts when one lands. Makespan of the 64 groups. Each turn
    re-prefills the conversation (18 prompt tokens, + 4 + 19 per turn) at PREFILL_TOKEN_ENGINE_S."""
    rows = []
    for mu in (0.3, 0.1):
        m = MEASURED[f"env{int(mu * 1000)}{suffix}"]
        work = planner.Workload(batch_size=64, group_size=4, prompt_len=ENV_PROMPT_TOKENS, lengths=lambda rng: 4,
                                num_turns=8, turn_tokens=ENV_TURN_TOKENS,
                                env_latency=lambda rng, m_=mu: max(0.0, rng.gauss(m_, m_)), max_inflight_groups=16)
        out: dict[str, dict[str, float]] = {"batch": {}, "async": {}}
        for cs in sets:
            c = cs.costs("L2H64", cap=64, request_s=req.get(cs.name), prefill_token_s=PREFILL_TOKEN_ENGINE_S)
            kw = dict(num_engines=1, alpha=100, seeds=seeds, steps=4)
            out["batch"][cs.name] = sim(work, c, scheduling="batch", env_mode="batch", **kw).total_s
            out["async"][cs.name] = sim(work, c, **kw).total_s
        cmd, b = m["cmd"], f"env async (64 instances, 8 turns, μ=σ={int(mu * 1000)} ms)" + m["tag"]
        rows += [row(b, "batch makespan s", cmd, m["batch"], m.get("batch_rounds", []), out["batch"]),
                 row(b, "async makespan s", cmd, m["async"], m.get("async_rounds", []), out["async"]),
                 row(b, "speedup", cmd, m["batch"] / m["async"], [],
                     {k: out["batch"][k] / out["async"][k] for k in out["batch"]})]
    return rows


# ---- paper shape -----------------------------------------------------------------------------------------

def paper_shape(*, steps: int, seeds: int, gpus: list[int], sigmas: list[float], batch: int, max_len: int,
                len_mean: float, alpha: int, sigma_gpus: int) -> dict:
    """Model only: 7B (28 layers, 4 KV heads), H100 table, lognormal lengths, α = `alpha`. For each total GPU
    count the best train/rollout split (train GPUs in steps of G/8) vs synchronous colocated training on all
    G GPUs; then at `sigma_gpus` GPUs the same vs the length spread σ."""
    model = planner.ModelSpec(num_params=7e9, num_layers=28, hidden_size=3584, num_kv_heads=4, head_dim=128)
    gpu = planner.GPUSpec.from_name("H100")

    def best(total: int, sigma: float) -> dict:
        work = planner.Workload(batch_size=batch, group_size=8, prompt_len=512,
                                lengths=planner.lognormal_lengths(len_mean, sigma, max_len))
        mean = planner._mean_len(work)
        costs = planner.Costs.from_models(model=model, gpu=gpu, engine_tp=1, mean_ctx=512 + mean / 2,
                                          max_ctx=512 + max_len, prompt_len=512)
        run = lambda **kw: statistics.fmean(planner.simulate(work=work, costs=costs, num_steps=steps, seed=s,  # noqa: E731
                                                             **kw).sec_per_step for s in range(seeds))
        base = run(num_engines=total, train_gpus=total, alpha=0, colocated=True)
        unit = max(1, total // 8)
        rows = [(base / run(num_engines=total - t, train_gpus=t, alpha=alpha), t) for t in range(unit, total, unit)]
        sp, t = max(rows)
        return {"speedup": round(sp, 3), "train_gpus": t, "rollout_gpus": total - t, "sync_s_per_step": round(base, 2),
                "mean_len": round(mean, 1)}

    out: dict = {"vs_gpus": {}, "vs_sigma": {}}
    for g in gpus:
        out["vs_gpus"][g] = best(g, 1.0)
        print(f"  {g:>3} GPUs, σ = 1.0: {out['vs_gpus'][g]}", flush=True)
    for sg in sigmas:
        out["vs_sigma"][sg] = best(sigma_gpus, sg)
        print(f"  {sigma_gpus} GPUs, σ = {sg}: {out['vs_sigma'][sg]}", flush=True)
    return out


# ---- main ------------------------------------------------------------------------------------------------

def validate(*, seeds: int, steps: int, log: Callable[[str], None] = print) -> dict:
    alone = CostSet("alone")
    loaded = CostSet("loaded 2026-11-22", step_small=STEP_LOADED_2026_11_22, step_large=STEP_LOADED_2026_11_22)
    fitted = CostSet("stage time")
    req = {"stage time": fit_request_cost(MEASURED["avs2"], alone, seeds=seeds, steps=steps)}
    req16 = {"stage time": fit_request_cost(MEASURED["avs16"], alone, seeds=seeds, steps=steps)}
    log(f"engine seconds per request solved from the α = 0 rollout stage: 2-core box {req['stage time'] * 1e3:.2f} ms, "
        f"16-core box {req16['stage time'] * 1e3:.2f} ms (alone, closed loop: {ENGINE_PER_REQUEST_S * 1e3:.1f} ms)")
    sets = [alone, loaded, fitted]
    rows = async_vs_sync("avs2", sets, req, seeds=seeds, steps=steps)
    rows += queue_scheduling(sets, req, seeds=seeds, steps=steps)
    rows += prompt_replication(8, sets, req, seeds=seeds, steps=steps)
    rows += prompt_replication(16, sets, req, seeds=seeds, steps=steps)
    rows += env_async(sets, req, seeds=seeds)
    # 2-core box, 2026-11-24 (before f55fc73): replication re-measured next to a fresh decode-step curve (same box,
    # same hour)
    rows += prompt_replication(8, [CostSet("alone", step_small=STEP_2026_11_24_EARLY_L2_H64),
                                   CostSet("stage time", step_small=STEP_2026_11_24_EARLY_L2_H64)], req, seeds=seeds,
                               steps=steps, key="rep8_2026_11_24_early")
    # 2-core box, 2026-11-24: async_vs_sync re-run minutes before a fresh 4 × 160 curve and closed-loop request
    # cost (after the local engine server's cheaper request path); the stage-time set solves its own request cost from
    # this run's α = 0 rollout stage, so only its α = 2 rows are predictions.
    nov24 = dict(step_large=STEP_2026_11_24_L4_H160, request_s=ENGINE_PER_REQUEST_2026_11_24,
                 client_s=CLIENT_CPU_PER_REQUEST_2026_11_24)
    alone_nov24 = CostSet("alone", **nov24)
    req_nov24 = {"stage time": fit_request_cost(MEASURED["avs2_2026_11_24"], alone_nov24, seeds=seeds, steps=steps)}
    log(f"2026-11-24 2-core run: engine seconds per request solved from its α = 0 stage "
        f"{req_nov24['stage time'] * 1e3:.2f} ms (closed loop alone {ENGINE_PER_REQUEST_2026_11_24 * 1e3:.2f} ms)")
    same_hour = async_vs_sync("avs2_2026_11_24", [alone_nov24, CostSet("stage time", **nov24)], req_nov24, seeds=seeds,
                              steps=steps)
    # Same day: queue scheduling and replication next to a fresh 2 × 64 curve; `alone` takes the closed-loop
    # request cost at the benchmark's running requests, `stage time` the one solved from avs2_2026_11_24.
    fitted_nov24 = CostSet("stage time", step_small=STEP_2026_11_24_L2_H64, client_s=CLIENT_CPU_PER_REQUEST_2026_11_24)
    same_hour += queue_scheduling([CostSet("alone", step_small=STEP_2026_11_24_L2_H64,
                                           request_s=ENGINE_PER_REQUEST_2026_11_24_CAP4,
                                           client_s=CLIENT_CPU_PER_REQUEST_2026_11_24), fitted_nov24], req_nov24,
                                  seeds=seeds, steps=steps, key="queue_2026_11_24")
    same_hour += prompt_replication(8, [CostSet("alone", step_small=STEP_2026_11_24_L2_H64,
                                                request_s=ENGINE_PER_REQUEST_2026_11_24_CAP8,
                                                client_s=CLIENT_CPU_PER_REQUEST_2026_11_24), fitted_nov24], req_nov24,
                                    seeds=seeds, steps=steps, key="rep8_2026_11_24")
    same_hour += env_async([CostSet("alone", step_small=STEP_2026_11_24_ENV_L2_H64,
                                    request_s=ENGINE_PER_REQUEST_2026_11_24_CAP64,
                                    client_s=CLIENT_CPU_PER_REQUEST_2026_11_24),
                            CostSet("stage time", step_small=STEP_2026_11_24_ENV_L2_H64,
                                    client_s=CLIENT_CPU_PER_REQUEST_2026_11_24)],
                           req_nov24, seeds=seeds, suffix="_2026_11_24")
    for r in same_hour:
        r["same_hour"] = True  # every input measured within minutes of the benchmark, on the same box
    rows += same_hour
    rows += async_vs_sync("avs16", [alone, fitted], req16, seeds=seeds, steps=steps)
    # 16-core box: its own decode-step curve for the 2 × 64 model; the stage-time set keeps the per-request
    # engine seconds solved from that box's async_vs_sync stage (with the 2-core 4 × 160 curve: the 16-core
    # box's curve for that model was not measured).
    alone16 = CostSet("alone", step_small=STEP16_L2_H64)
    fitted16 = CostSet("stage time", step_small=STEP16_L2_H64)
    rows += prompt_replication(8, [alone16, fitted16], req16, seeds=seeds, steps=steps, key="rep8_16core")
    # The engines on a GPU: the planner fed with the CUDA decode curve of the same H200 run (nothing fitted).
    rows += queue_scheduling([CostSet("alone", step_small=STEP_H200_L2_H64, request_s=ENGINE_PER_REQUEST_H200,
                                      client_s=CLIENT_CPU_PER_REQUEST_2026_11_24)], {}, seeds=seeds, steps=steps,
                             key="queue_h200")
    for r in rows:
        r.setdefault("same_hour", False)
    return {"rows": rows, "request_engine_s": {"2-core": round(req["stage time"], 6),
                                               "2-core 2026-11-24": round(req_nov24["stage time"], 6),
                                               "16-core": round(req16["stage time"], 6)}}


def summary(rows: list[dict], cost: str) -> dict:
    held = [r for r in rows if cost in r["error"] and cost not in r["fit"]]
    within = [r for r in held if abs(r["error"][cost]) <= 0.15]
    return {"held_out": len(held), "within_15pct": len(within),
            "max_abs_error": round(max(abs(r["error"][cost]) for r in held), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--lengths", choices=("measured", "inv_k"), default="measured",
                   help="response lengths: the long-tail model's measured histogram, or P(k) ∝ 1/k, k ≤ 32")
    p.add_argument("--runs", default="", help="directory holding bench_* run directories (e.g. runs)")
    p.add_argument("--paper-shape", action="store_true", help="also sweep GPU count and length spread (model only)")
    p.add_argument("--gpus", default="8,16,24,32,40,64")
    p.add_argument("--sigmas", default="0.25,0.5,0.75,1.0,1.25,1.5")
    p.add_argument("--sigma-gpus", type=int, default=40)
    p.add_argument("--sweep-batch", type=int, default=512)
    p.add_argument("--sweep-len-mean", type=float, default=2000)
    p.add_argument("--sweep-max-len", type=int, default=16384)
    p.add_argument("--sweep-steps", type=int, default=20)
    p.add_argument("--sweep-seeds", type=int, default=2)
    p.add_argument("--alpha", type=int, default=2, help="α of the paper-shape sweep")
    args = p.parse_args(argv)
    random.seed(0)
    LENGTHS["mode"] = args.lengths
    t0 = time.time()
    sources = read_runs(args.runs) if args.runs else []
    print("measured outputs: " + ("run directories " + ", ".join(sources) if sources else
                                  "constants recorded in docs/benchmarks.md (no --runs)"))
    out = validate(seeds=args.seeds, steps=args.steps)
    rows = out["rows"]
    costs = ["alone", "loaded 2026-11-22", "stage time"]
    widths = {c: max(16, len(c)) for c in costs}
    head = f"  {'':<48} {'measured':>8} {'rounds':>11} " + " ".join(f"{c:>{widths[c]}}" for c in costs)
    last = None
    for r in rows:
        if r["benchmark"] != last:
            last = r["benchmark"]
            print(f"\n{last}: {r['command']}\n{head}")
        rng = f"{min(r['rounds']):.3f}-{max(r['rounds']):.3f}" if r["rounds"] else ""
        cells = []
        for c in costs:
            if c not in r["predicted"]:
                cells.append(f"{'':>{widths[c]}}")
                continue
            tag = "fit" if c in r["fit"] else f"{r['error'][c]:+.0%}"
            cells.append(f"{r['predicted'][c]:>{widths[c] - 7}.3f} {tag:>6}")
        print(f"  {r['what']:<48} {r['measured']:>8.3f} {rng:>11} " + " ".join(cells))
    print()
    summ = {c: summary(rows, c) for c in costs}
    summ_same = {c: summary([r for r in rows if r["same_hour"]], c) for c in ("alone", "stage time")}
    for title, sums in (("", summ), ("rows whose inputs were measured within minutes of the benchmark "
                                     "(2026-11-24, 2-core box):", summ_same)):
        if title:
            print(title)
        for c, s in sums.items():
            print(f"{c:>10}: {s['within_15pct']} of {s['held_out']} predictions within ±15 %, largest error "
                  f"{s['max_abs_error']:.0%}")
    shape = None
    if args.paper_shape:
        print(f"\npaper shape: 7B on H100, lognormal lengths mean {args.sweep_len_mean:.0f} (≤ {args.sweep_max_len}), "
              f"B = {args.sweep_batch}, α = {args.alpha}; best split vs synchronous colocated", flush=True)
        shape = paper_shape(steps=args.sweep_steps, seeds=args.sweep_seeds, gpus=[int(x) for x in args.gpus.split(",")],
                            sigmas=[float(x) for x in args.sigmas.split(",")], batch=args.sweep_batch,
                            max_len=args.sweep_max_len, len_mean=args.sweep_len_mean, alpha=args.alpha,
                            sigma_gpus=args.sigma_gpus)
    print(f"({time.time() - t0:.0f} s)")
    print(json.dumps({"rows": rows, "summary": summ, "summary_same_hour": summ_same,
                      "request_engine_s": out["request_engine_s"],
                      "keep_prob": round(KEEP_PROB, 4), "lengths": args.lengths, "sources": sources,
                      "paper_shape": shape}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
