"""Prompt replication on vs off: a prompt's n responses as n requests spread over engines, or one request
with SGLang's `n` on one engine.

    OMP_NUM_THREADS=1 python benchmarks/prompt_replication.py [--steps 10] [--rounds 2] [--engines 2] [--max-inflight 8]

Both modes run the product's rollout (`launch/pretrain_async_rl.py trainer.mode=rollout_only`, no
trainer) on the same --engines local engine servers (same flags), same model and data; only
`rollout.prompt_replication` differs:

  on    each response is its own request; the proxy sends it to the least-loaded engine the moment
        a slot frees (slots: --max-inflight per engine, `engines.max_inflight_per_engine`), so a
        group's n responses spread over the engines and each slot frees when its response ends;
  off   one request per prompt asks for n samples (`generate_n`); it runs on one engine and holds n
        slots there until its slowest response ends.

Workload: the long-tail model of benchmarks/benchlib.py (response lengths P(k) ∝ 1/k, 1 ≤ k ≤ --max-len,
independently per response, so a group's slowest response is ~3× its mean); --prompts × --n samples
per step; α = --alpha (default 2: the rollout side runs ahead, so steps measure generation
throughput, not a per-step barrier; --alpha 0 measures a synchronous step's rollout). The first --skip
steps are left out; modes interleave over --rounds. Default --max-inflight 8 = one group per engine
with replication off: a decode step of the local engine costs about the same for 1 to ~8 sequences,
as a GPU's does up to large batches, so a slot held by a finished response wastes about what it
wastes on a GPU (docs/benchmarks.md has --max-inflight 16 too, where per-request overhead wins).
--decode-step-ms T (e.g. 20, above the CPU step at --max-inflight) makes every engine step last T ms for
1 to --max-inflight sequences, as a GPU's does (latency injection; engines/local_server.py).

The last line is a JSON object: seconds per step and engine idle fraction per mode, `speedup` =
s/step(off) / s/step(on) (paper: 1.84–1.95×). `--chunk K` adds a third mode, replication in requests
of K samples (`rollout.replication_chunk`), and `speedup_chunked` = s/step(off) / s/step(chunked).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--skip", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="runs per mode, interleaved")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--max-inflight", type=int, default=8,
                   help="engines.max_inflight_per_engine (>= --n: one request with n holds n slots)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--alpha", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--max-len", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=512, help="--engine-decoder cb: engine KV blocks of 16 tokens")
    p.add_argument("--chunk", type=int, default=0,
                   help="also run mode 'chunked': replication with rollout.replication_chunk=K samples per request")
    p.add_argument("--model-path", default="")
    p.add_argument("--out", default="runs/bench_prompt_replication")
    benchlib.add_engine_device_args(p)
    args = p.parse_args()
    name = "prompt_replication"
    model = args.model_path or benchlib.long_tail_model(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                                        max_len=args.max_len, name=name)
    batch = args.prompts * args.n
    common = ["data.task=countdown", "trainer.mode=rollout_only", f"trainer.total_steps={args.steps}",
              f"trainer.global_batch_size={batch}", f"trainer.micro_batch_size={batch}",
              f"rollout.n_samples_per_prompt={args.n}", f"rollout.max_new_tokens={args.max_len + 8}",
              f"trainer.max_seq_len={args.max_len + 16}", f"async_rl.alpha={args.alpha}",
              f"engines.max_inflight_per_engine={args.max_inflight}",
              *[f"engines.server_args.{k}={v}" for k, v in {
                  **benchlib.engine_capacity_server_args(args, max_running=args.max_inflight,
                                                         request_tokens=args.max_len + 16, num_blocks=args.num_blocks),
                  **benchlib.engine_device_server_args(args)}.items()]]
    keys = ("time_step", "engine_idle_frac", "tokens_per_s", "response_len_mean")
    modes = ["off", "on"] + (["chunked"] if args.chunk > 1 else [])
    results: dict[str, list[dict]] = {m: [] for m in modes}
    mode_overrides = {"off": ["rollout.prompt_replication=false"], "on": ["rollout.prompt_replication=true"],
                      "chunked": ["rollout.prompt_replication=true", f"rollout.replication_chunk={args.chunk}"]}
    t0, load_before = time.time(), benchlib.uptime_load()
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            rows, mon = benchlib.run_pipeline(
                model=model, run_dir=os.path.join(benchlib.REPO, args.out, f"{mode}_r{r}"), name=name,
                num_engines=args.engines, monitor=True,
                overrides=[*common, *mode_overrides[mode]])
            s = benchlib.steady(rows, skip=args.skip, keys=keys)
            s.update(mon.cores(skip=args.skip) if mon is not None else {})
            if "cores_engines" in s:  # engine CPU per generated token: how hard the engines worked, load aside
                s["engine_cpu_ms_per_token"] = 1e3 * s["cores_engines"] / max(s["tokens_per_s"], 1e-9)
            results[mode].append(s)
            benchlib.log(name, f"replication {mode} round {r}: {s['time_step']:.3f} s/step, engine idle "
                               f"{s['engine_idle_frac']:.2f}")

    result: dict = {"engines": args.engines, "max_inflight_per_engine": args.max_inflight, "prompts": args.prompts,
                    "n": args.n, "alpha": args.alpha, "steps": args.steps, "skip": args.skip, "rounds": args.rounds,
                    "model": os.path.relpath(model, benchlib.REPO), "decode_step_ms": args.decode_step_ms}
    for mode in modes:
        result[mode] = {k: benchlib.round_mean(results[mode], k) for k in (*keys, "cores_trainer", "cores_engines", "cores_others",
                                                   "engine_cpu_ms_per_token")}
        result[mode]["samples_per_s"] = round(batch / result[mode]["time_step"], 2)
        result[mode]["sec_per_step_per_round"] = [round(s["time_step"], 3) for s in results[mode]]
    result.update(benchlib.speedup_fields(results["off"], results["on"]))
    if "chunked" in results:
        result["chunk"] = args.chunk
        result["speedup_chunked"] = round(result["off"]["time_step"] / result["chunked"]["time_step"], 3)
    result["load_avg_1m_before"] = load_before
    result["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
