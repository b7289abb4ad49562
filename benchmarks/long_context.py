"""Long sequences under context parallelism: per-rank activation memory and step time against CP1.

    python benchmarks/long_context.py --seq-len 8192,16384,32768,65536 --cp 1,2,4     # the full table
    python benchmarks/long_context.py --seq-len 2048,4096,8192 --cp 1,2,4 --num-layers 1 --num-heads 1
                                                                        # what a 2-core, 24 GiB box holds

For every (seq_len, cp): a small Llama (`--hidden-size`, `--num-layers`, `--num-heads` / `--num-kv-heads`,
random weights, built once per length by tools/make_tiny_model.py) takes optimizer steps (SGD: no
optimizer state to allocate) on one packed row of `--sequences` sequences (a 16-token prompt each)
that fill `seq_len` tokens, the tis loss, launched by torchrun on `cp` processes with
parallel.context_parallel_size = cp (one thread each on a CPU). A short warm-up step first, then:

  peak_activation_gb  the largest CP rank's peak during one full-length step over its memory before
                      it: CUDA: the allocator's peak; CPU: the process's peak RSS (ru_maxrss)
  step_s              the second full-length step's wall time (rank 0's clock; the ranks wait on
                      each other in the K/V gathers)
  attention_s         per CP rank: time spent in the core attention's forward (module hooks), the
                      balance of the 2·CP chunk split; attention_pairs: the (query, key) pairs each
                      rank's plan holds

One JSON line per row ({"seq_len", "cp", "peak_activation_gb", "step_s", "attention_s",
"attention_pairs", "tokens_per_rank"}; "error" instead when the row failed, e.g. out of memory), then a
summary line with the ratios to CP1 at each length.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def lengths_for(seq_len: int, sequences: int) -> list[int]:
    """`sequences` lengths that sum to `seq_len` (the first takes the remainder)."""
    each = seq_len // sequences
    return [seq_len - each * (sequences - 1)] + [each] * (sequences - 1)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from megatron_flash.config.schema import OptimizerConfig
    from megatron_flash.losses import get_loss
    from megatron_flash.trainer import context_parallel
    from megatron_flash.trainer.loss_adapter import make_loss_fn
    from megatron_flash.trainer.model_builder import ScaleOptions
    from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings
    from megatron_flash.types import Sample, collate

    cuda = torch.cuda.is_available() and args.device != "cpu"
    policy = MegatronPolicy(PolicySettings(
        hf_path=args.model, dtype=args.dtype, micro_batch_size=args.sequences, max_tokens_per_micro_batch=args.seq_len * 2,
        optimizer=OptimizerConfig(name="sgd", lr=1e-9, clip_grad=1e6), attention_backend="flash" if cuda else "local",
        scale=ScaleOptions(context_parallel_size=args.cp)))
    loss_fn = make_loss_fn(get_loss("tis"))

    def batch(seq_len: int) -> Any:
        gen = torch.Generator().manual_seed(0)
        samples = []
        for i, n in enumerate(lengths_for(seq_len, args.sequences)):
            ids = torch.randint(1, policy.spec.vocab_size, (n,), generator=gen).tolist()
            samples.append(Sample(prompt_ids=ids[:16], response_ids=ids[16:],
                                  behavior_logprobs=(-torch.rand(n - 16, generator=gen)).tolist(), reward=float(i % 2),
                                  group_id=0))
        return collate(samples, pad_id=0, advantages=torch.randn(len(samples), generator=gen))

    attention = [0.0]
    started: list[float] = []

    def pre(module: Any, inputs: Any) -> None:
        if cuda:
            torch.cuda.synchronize()
        started.append(time.perf_counter())

    def post(module: Any, inputs: Any, output: Any) -> None:
        if cuda:
            torch.cuda.synchronize()
        attention[0] += time.perf_counter() - started.pop()
    for chunk in policy.chunks:
        for module in chunk.modules():
            if type(module).__name__.endswith("DotProductAttention"):
                module.register_forward_pre_hook(pre)
                module.register_forward_hook(post)

    policy.train_step(batch(64 * args.sequences * 2 * args.cp), loss_fn)  # warm-up: lazies allocated
    full = batch(args.seq_len)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    policy.train_step(full, loss_fn)
    peak = (torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    attention[0] = 0.0
    t0 = time.perf_counter()
    metrics = policy.train_step(full, loss_fn)
    step_s = time.perf_counter() - t0
    pairs = 0
    if args.cp > 1:
        from megatron_flash.trainer.packing import round_up

        padded = [round_up(n, 2 * args.cp) for n in lengths_for(args.seq_len, args.sequences)]
        pairs = context_parallel.split(padded, cp_size=args.cp, rank=policy.layout.cp_rank).attention_pairs
    mine = {"peak_gb": (peak - base) / 2**30, "attention_s": attention[0], "pairs": pairs,
            "tokens": int(metrics["tokens_computed"])}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        print(json.dumps({"seq_len": args.seq_len, "cp": args.cp, "peak_activation_gb": max(r["peak_gb"] for r in every),
                          "step_s": step_s, "attention_s": [round(r["attention_s"], 4) for r in every],
                          "attention_pairs": [r["pairs"] for r in every],
                          "tokens_per_rank": [r["tokens"] for r in every], "loss": metrics["loss"]}), flush=True)


def make_model(out: str, args: argparse.Namespace, seq_len: int) -> None:
    subprocess.run([sys.executable, "tools/make_tiny_model.py", "--out", out, "--arch", "llama",
                    "--hidden-size", str(args.hidden_size), "--num-layers", str(args.num_layers),
                    "--num-heads", str(args.num_heads), "--num-kv-heads", str(args.num_kv_heads),
                    "--max-positions", str(seq_len)], cwd=REPO, check=True, capture_output=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", default="8192,16384,32768,65536", help="comma-separated row lengths (tokens)")
    p.add_argument("--cp", default="1,2,4", help="comma-separated context-parallel sizes")
    p.add_argument("--sequences", type=int, default=1, help="sequences packed in the row")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu"])
    p.add_argument("--timeout", type=int, default=1800, help="seconds per row")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.seq_len, args.cp = int(args.seq_len), int(args.cp)
        worker(args)
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="long_context_", dir=os.path.join(REPO, "runs") if os.path.isdir(
            os.path.join(REPO, "runs")) else None) as tmp:
        for seq_len in (int(x) for x in args.seq_len.split(",")):
            model = os.path.join(tmp, f"llama_{seq_len}")
            make_model(model, args, seq_len)
            for cp in (int(x) for x in args.cp.split(",")):
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cp}",
                       os.path.abspath(__file__), "--worker", "--model", model, "--seq-len", str(seq_len), "--cp",
                       str(cp), "--sequences", str(args.sequences), "--dtype", args.dtype, "--device", args.device]
                env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                       "PYTHONWARNINGS": "ignore", "PYTHONPATH": REPO}
                try:
                    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
                    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
                    row = json.loads(lines[-1]) if proc.returncode == 0 and lines else {
                        "seq_len": seq_len, "cp": cp, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}
                except subprocess.TimeoutExpired:
                    row = {"seq_len": seq_len, "cp": cp, "error": f"over {args.timeout} s"}
                rows.append(row)
                print(json.dumps(row), flush=True)
    ratios = {}
    for row in rows:
        one = next((r for r in rows if r["seq_len"] == row["seq_len"] and r["cp"] == 1 and "error" not in r), None)
        if one and "error" not in row and row["cp"] > 1:
            ratios[f"{row['seq_len']}/cp{row['cp']}"] = {
                "memory_vs_cp1": round(row["peak_activation_gb"] / one["peak_activation_gb"], 3),
                "speedup_vs_cp1": round(one["step_s"] / row["step_s"], 3),
                "attention_spread": round(max(row["attention_s"]) / min(row["attention_s"]) - 1, 3)}
    print(json.dumps({"ratios": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
