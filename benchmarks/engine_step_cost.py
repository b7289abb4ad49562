"""Decode-step cost and per-request cost of the local engine server, the planner's measured inputs.

    OMP_NUM_THREADS=1 python benchmarks/engine_step_cost.py [--num-layers 2] [--hidden-size 64] [--k 1,2,4,8,16,32,64]

One local engine server (1 thread, a model of the given size built by tools/make_tiny_model.py, KV for
64 × 128 tokens). For each k: k concurrent requests of a 4-token prompt with exactly L new tokens
(ignore_eos), L = --short and --long, each timed --repeats times (median). Two lengths separate the
costs: step(k) = (T(k, long) − T(k, short)) / (long − short) is one decode step with k sequences;
per_request(k) = (T(k, short) − short · step(k)) / k is what each request costs besides its decode
steps (HTTP, admission, prefill, the client), per request when k run together.
Last line: JSON {"step_s": {k: s}, "per_request_s": {k: s}} — `tools/validate_planner.py` reads it.
Beside each k, the engine's own per-step split over those runs (`step_profile`, engines/step_profile.py):
the whole loop pass, the generation step (forward, sampler, outputs to the host), our sampler alone, and
the host-side scheduling and bookkeeping around the step — where a fixed per-step cost shows.

`--loop-k 4,8,16` adds a closed loop per k, the way a rollout feeds an engine: k workers, each sending
its next request the moment its previous one returns, until --loop-requests requests are done, for
both lengths. Requests then arrive one at a time, so each gets its own admission and prefill instead
of sharing them with k − 1 others as above. From T(L) = N · (per_request + L · step / k):
loop_per_request_s(k) = (L_long · T_short − L_short · T_long) / (N · (L_long − L_short)) and
loop_step_s(k) = k · (T_long − T_short) / (N · (L_long − L_short)); the engine process's CPU seconds
(from /proc) give the same two per request in CPU time (`loop_cpu_*`), which other load on the
machine inflates less than wall time.

`--loop-prompt-len 2,100` runs each closed loop with prompts of those lengths (default 2): the difference in
per-request cost over the difference in length is the engine's seconds per prefilled token, what a multi-turn
episode pays again each turn on an engine without a prefix cache (the local engine server). `--max-batch-tokens`
sets the server's tokens per forward step (env_async.py uses 512).

`--loop-n 1,8` also runs each closed loop with requests of one prompt and n = 8 sampled sequences
(SGLang's `sampling_params.n`, how the rollout sends a group without prompt replication), the same
number of sequences in all: k workers then keep k · n sequences running, and `loop_per_request_s` is
per HTTP request. Side by side with n = 1 this splits the engine-exclusive cost into a per-request and
a per-sequence part (the local engine server admits and prefills the n members separately).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.trainer_throughput import PRESETS  # noqa: E402  (the same Qwen2.5 shapes as the trainer's rows)


def step_profile(url: str) -> dict:
    import requests

    return requests.get(f"{url}/get_server_info", timeout=30).json().get("step_profile") or {"steps": 0}


async def timed(url: str, k: int, length: int, prompt_len: int = 4) -> float:
    from megatron_flash.engines.client import EngineClient

    params = {"temperature": 1.0, "max_new_tokens": length, "ignore_eos": True}
    async with EngineClient(url) as client:
        t0 = time.perf_counter()
        prompts = [[1] + [4 + (i * 7 + j) % 40 for j in range(prompt_len - 1)] for i in range(k)]  # distinct
        outs = await asyncio.gather(*(client.generate(prompt, params, return_logprob=True) for prompt in prompts))
        took = time.perf_counter() - t0
    assert all(len(o.output_ids) == length for o in outs)
    return took


def loop_prompt(length: int) -> list[int]:
    """The closed loop's prompt: [1, 5] (the default, length 2) or `length` tokens of the same kind."""
    return [1] + [5 + i % 40 for i in range(length - 1)]  # the tiny tokenizer has 48 ids


async def closed_loop(url: str, k: int, length: int, total: int, n: int = 1, prompt_len: int = 2) -> float:
    """k workers, each sending its next request (n sampled sequences) as soon as its last returns, `total`
    requests in all."""
    prompt = loop_prompt(prompt_len)
    from megatron_flash.engines.client import EngineClient

    params = {"temperature": 1.0, "max_new_tokens": length, "ignore_eos": True}
    left = [total]

    async def worker(client: EngineClient) -> None:
        while left[0] > 0:
            left[0] -= 1
            outs = await client.generate_n(prompt, params, n, return_logprob=True)
            assert len(outs) == n and all(len(o.output_ids) == length for o in outs)

    async with EngineClient(url) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(k)))
        return time.perf_counter() - t0


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=0, help="model vocabulary (default: the tiny tokenizer's 48)")
    p.add_argument("--k", default="1,2,4,8,16,32,64")
    p.add_argument("--short", type=int, default=8)
    p.add_argument("--long", type=int, default=72)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--loop-k", default="", help="closed-loop concurrency levels, e.g. 4,8,16 (empty: skip)")
    p.add_argument("--loop-requests", type=int, default=256)
    p.add_argument("--loop-n", default="1", help="sampled sequences per closed-loop request (SGLang n), e.g. 1,8")
    p.add_argument("--skip-batch", action="store_true", help="only the closed loop")
    p.add_argument("--loop-prompt-len", default="2",
                   help="closed-loop prompt lengths, e.g. 2,100: the difference in per-request cost is prefill")
    p.add_argument("--max-batch-tokens", type=int, default=0,
                   help="local engine server tokens per forward step (0: max(256, 4 x the most running))")
    p.add_argument("--device", default="cpu", help="local engine device: cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="", help="local engine dtype (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--model-path", default="", help="serve this HF model instead of a tiny one")
    p.add_argument("--preset", default="", choices=["", *PRESETS],
                   help="a Qwen2.5-shaped model with random weights (0.5b, 1.5b), bf16, 4096 positions")
    p.add_argument("--decoder", default="static",
                   help="local engine decoders to measure one after the other, e.g. static,cb (same model and load)")
    p.add_argument("--prompt-len", type=int, default=4,
                   help="prompt tokens of the k concurrent requests (the context each decode step attends to)")
    p.add_argument("--no-cuda-graph", action="store_true", help="static decoder on CUDA: eager steps")
    p.add_argument("--decode-step-ms", type=float, default=0.0,
                   help="local engine --decode-step-ms (latency injection: the step's floor; 0: off)")
    args = p.parse_args(argv)
    decoders = [d for d in args.decoder.split(",") if d]
    if any(d not in ("static", "cb") for d in decoders):
        p.error(f"--decoder {args.decoder!r}: each must be static or cb")

    from benchmarks.benchlib import env, free_ports
    from megatron_flash.engines.step_profile import per_step
    from megatron_flash.engines.launcher import EngineLauncher

    work = tempfile.mkdtemp(prefix="mf_step_cost_")
    model = args.model_path or os.path.join(work, "model")
    shape = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size)]
    if args.preset:
        arch, layers, hidden, heads, kv, ffn, vocab = PRESETS[args.preset]
        args.num_layers, args.hidden_size, args.vocab_size = layers, hidden, vocab
        shape = ["--arch", arch, "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-heads", str(heads),
                 "--num-kv-heads", str(kv), "--intermediate-size", str(ffn)]
    if not args.model_path:
        subprocess.run([sys.executable, os.path.join(REPO, "tools/make_tiny_model.py"), "--out", model, *shape,
                        "--max-positions", "4096"]
                       + (["--vocab-size", str(args.vocab_size)] if args.vocab_size else []), check=True, env=env(),
                       stdout=subprocess.DEVNULL)
    ks = [] if args.skip_batch else [int(x) for x in args.k.split(",")]
    loop_ks = [int(x) for x in args.loop_k.split(",") if x]
    loop_ns = [int(x) for x in args.loop_n.split(",") if x]
    loop_ps = [int(x) for x in args.loop_prompt_len.split(",") if x]
    if any(x < 1 for x in loop_ps):
        p.error(f"--loop-prompt-len {args.loop_prompt_len!r}: lengths must be >= 1")
    results = {decoder: measure(args, decoder, model, work, ks, loop_ks, loop_ns, loop_ps) for decoder in decoders}
    first = results[decoders[0]]
    print(json.dumps({"num_layers": args.num_layers, "hidden_size": args.hidden_size, "vocab_size": args.vocab_size,
                      "preset": args.preset or None, "prompt_len": args.prompt_len, "device": args.device,
                      "decode_step_ms": args.decode_step_ms,
                      "decoder": decoders[0], **first,
                      "by_decoder": results if len(decoders) > 1 else None,
                      "load_avg_1m": os.getloadavg()[0]}))
    return 0


def measure(args: argparse.Namespace, decoder: str, model: str, work: str, ks: list[int], loop_ks: list[int],
            loop_ns: list[int], loop_ps: list[int]) -> dict:
    """One engine server with `decoder`: the batch rows (step and per-request cost per k) and the closed loops."""
    from benchmarks.benchlib import free_ports
    from megatron_flash.engines.launcher import EngineLauncher
    from megatron_flash.engines.step_profile import per_step

    print(f"-- decoder {decoder}", flush=True)
    most = max(ks + [k * max(loop_ns) for k in loop_ks])
    longest = max(4, args.prompt_len, *loop_ps) + args.long
    server_args = {"decoder": decoder, "device": args.device,
                   "dtype": args.dtype or ("float32" if args.device == "cpu" else "bfloat16")}
    if decoder == "cb":
        server_args.update({"num-blocks": most * -(-longest // 16) + 16,
                            "max-batch-tokens": args.max_batch_tokens or max(256, most * 4)})
    else:
        server_args.update({"max-running-requests": most, "context-length": longest + 8})
        if args.no_cuda_graph:
            server_args["disable-cuda-graph"] = True
    if args.decode_step_ms:
        server_args["decode-step-ms"] = args.decode_step_ms
    launcher = EngineLauncher(backend="local", model_path=model, num_engines=1, base_port=free_ports(1),
                              run_dir=os.path.join(work, decoder), server_args=server_args,
                              env={"OMP_NUM_THREADS": "1"})
    step, per_req, phases = {}, {}, {}
    with launcher:
        url = launcher.urls[0]
        for k in sorted({4, *ks}):  # warm-up: on CUDA the static decoder captures a graph per row bucket
            asyncio.run(timed(url, k, args.long, args.prompt_len))
        for k in ks:
            before = step_profile(url)
            t = {L: statistics.median(asyncio.run(timed(url, k, L, args.prompt_len)) for _ in range(args.repeats))
                 for L in (args.short, args.long)}
            step[k] = (t[args.long] - t[args.short]) / (args.long - args.short)
            per_req[k] = max(0.0, t[args.short] - args.short * step[k]) / k
            phases[k] = per_step(before, step_profile(url)) if before.get("installed") else {"steps": 0}
            split = "" if not phases[k]["steps"] else (
                " | engine per step: loop {loop_s:.2e} s = step {step_s:.2e} (sampler {sampler_s:.2e}) + host "
                "{host_s:.2e}".format(**phases[k]))
            print(f"k={k:>3}: T({args.short})={t[args.short]:.3f} s T({args.long})={t[args.long]:.3f} s → "
                  f"step {step[k] * 1e3:.2f} ms, per request {per_req[k] * 1e3:.2f} ms{split}", flush=True)
        loop: dict[str, dict[str, float]] = {}
        pid, n = launcher.pids[0], args.loop_requests
        for k, m, plen in [(k, m, q) for k in loop_ks for m in loop_ns for q in loop_ps]:
            reqs = max(1, n // m)  # the same number of sequences for every n
            t, c = {}, {}
            for L in (args.short, args.long):
                c0 = cpu_seconds(pid)
                t[L] = asyncio.run(closed_loop(url, k, L, reqs, m, plen))
                c[L] = cpu_seconds(pid) - c0
            span = reqs * (args.long - args.short)
            row = {"loop_per_request_s": (args.long * t[args.short] - args.short * t[args.long]) / span,
                   "loop_step_s": k * (t[args.long] - t[args.short]) / span,
                   "loop_cpu_per_request_s": (args.long * c[args.short] - args.short * c[args.long]) / span,
                   "loop_cpu_step_s": k * (c[args.long] - c[args.short]) / span,
                   "engine_busy_frac": (c[args.short] + c[args.long]) / (t[args.short] + t[args.long])}
            name = (str(k) if m == 1 else f"{k}x{m}") + ("" if plen == 2 else f"p{plen}")
            loop[name] = {key: round(v, 6) for key, v in row.items()}
            print(f"closed loop k={k:>3} n={m} prompt {plen}: T({args.short})={t[args.short]:.3f} s T({args.long})="
                  f"{t[args.long]:.3f} s for {reqs} requests → per request "
                  f"{row['loop_per_request_s'] * 1e3:.2f} ms (CPU {row['loop_cpu_per_request_s'] * 1e3:.2f}), "
                  f"step {row['loop_step_s'] * 1e3:.2f} ms (CPU {row['loop_cpu_step_s'] * 1e3:.2f}), "
                  f"engine busy {row['engine_busy_frac']:.2f}", flush=True)
    return {"step_s": {str(k): round(v, 6) for k, v in step.items()},
            "per_request_s": {str(k): round(v, 6) for k, v in per_req.items()}, "closed_loop": loop,
            "step_profile": {str(k): {key: round(v, 7) for key, v in row.items()} for k, row in phases.items()}}


if __name__ == "__main__":
    sys.exit(main())
