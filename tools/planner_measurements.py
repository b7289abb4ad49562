"""Measured inputs and outputs of the planner validation (tools/validate_planner.py): decode-step curves,
request costs, response lengths, and the benchmarks' step times, each with where it comes from
(docs/benchmarks.md). Data only."""

from __future__ import annotations

import statistics

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
    # 2-core box, 2026-11-27 08:40-08:44, quiet, adaptive admission the default (docs/benchmarks.md, "Asynchronous
    # learning at α = 2", Speed): `python benchmarks/async_vs_sync.py --rounds 2 --eager`. Recorded: sync 1.441
    # s/step; α = 2 adaptive 0.854 (train 0.629, trainer wait 0.107 a step, L = 1 held, token staleness 0.90) and
    # eager 0.854 (train 0.705, token staleness 1.86); ceiling for the α = 0 stage times 1.82×. Not recorded, so
    # inferred: the α = 0 rollout stage = 1.441 / 1.82 = 0.792 s (the longer stage: the α = 2 runs trained in
    # 0.63-0.71 s, and training at α = 0 is not slower than beside a rollout), train + sync at α = 0 the rest
    # (0.649 s); sync 0.118 s = 0.854 − 0.629 − 0.107 (adaptive's step is its wait, training and push), the same
    # for eager; response length mean as on 2026-11-24 (the same long-tail model).
    "avs2_2026_11_27": {"cmd": "python benchmarks/async_vs_sync.py --rounds 2 --eager (2026-11-27)",
                        "tag": ", 2-core box, 2026-11-27, adaptive vs eager admission",
                        "sync": 1.441, "sync_rounds": [], "async": 0.854, "async_rounds": [], "async_eager": 0.854,
                        "rollout": 0.792, "train": 0.531, "sync_s": 0.118, "train_async": 0.629,
                        "train_eager": 0.705, "sync_s_async": 0.118, "wait_async": 0.107, "lookahead_async": 1.0,
                        "token_staleness_async": 0.90, "token_staleness_eager": 1.86, "response_len_mean": 10.18},
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
