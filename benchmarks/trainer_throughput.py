"""Trainer throughput on a long-tail RL batch: padded micro-batches vs packed by token budget vs bare Megatron.

    python benchmarks/trainer_throughput.py                                   # CPU defaults (2 cores: ~3 min)
    python benchmarks/trainer_throughput.py --arch qwen3_moe                  # 8 experts, top-2 (Qwen3-MoE)
    python benchmarks/trainer_throughput.py --hidden-size 1024 --num-layers 16 --dtype bfloat16 \\
        --batch 128 --mean-len 2000 --max-len 16384                             # one GPU
    python benchmarks/trainer_throughput.py --device cuda --preset 0.5b      # Qwen2.5-0.5B shape, bf16,
    python benchmarks/trainer_throughput.py --device cuda --preset 1.5b      #   local vs flash attention
    python benchmarks/trainer_throughput.py --shared-prefix --prompt-len 256 --response-len 32 --group-size 8
                                          # a group's prompt once: benchmarks/shared_prefix_bench.py

One batch of `--batch` samples: a `--prompt-len`-token prompt and a response whose length is drawn
from a lognormal (σ = `--sigma`) with mean `--mean-len`, capped at `--max-len`; the longest response is
stretched until max/mean ≥ `--max-ratio` (6 by default) so the tail is always there. The same batch,
with the same policy (one MegatronPolicy, Adam, the `tis` loss through the product's loss adapter),
goes through three ways of training, alternated over `--rounds` rounds (side by side, so drift of the
machine hits all three alike):

  (a) padded   trainer.pack_sequences=false: every sample padded to the step's longest, fixed
               micro-batches of `--padded-micro-batch` samples (the trainer before packing)
  (b) packed   trainer.pack_sequences=true, trainer.max_tokens_per_micro_batch=`--max-tokens`
               (default: the longest sample): whole samples per row, DP-balanced by tokens
  (c) bare     Megatron alone: get_forward_backward_func over the very micro-batches (b) builds
               (built before the clock starts), a trivial loss (sum of the logits), the same
               optimizer step; none of the product's batching, logprob or loss code

With a MoE model (`--arch qwen3_moe`) a fourth way runs beside them:

  (d) replay   (b) with rollout routing replay: the batch carries a route for every token (random
               distinct experts per layer, as an engine would return them) and every router replays
               them (trainer.moe_routing_replay=rollout), the agreement metric included

With `--attention both` (the presets' default on CUDA) the packed way runs twice, with the local
spec's per-sample attention (packed_attention.py: `packed`) and with torch's varlen flash attention
(flash_attention.py: `flash`), the same weights (the core-attention modules are switched between
rounds). `--preset 0.5b|1.5b`: a Qwen2.5-shaped model (0.5b: 24 × 896, 14 heads / 2 KV, MLP 4864;
1.5b: 28 × 1536, 12 / 2, 8960; 151936-token vocabulary, random weights), bf16, 16 samples of mean ≈
1k and max ≈ 8k tokens, a 16k-token micro-batch budget.

tokens/s counts real tokens (prompt + response of every sample) per second of a full optimizer step.
Last line, one JSON object: tokens_per_s_padded, tokens_per_s_packed, speedup (b ÷ a), ratio_to_bare
(b ÷ c), padding_frac_padded, padding_frac_packed (share of computed positions that are padding),
for MoE replay_over_packed (d ÷ b), and the pinned fields: tokens_per_s (the fastest packed way),
mfu (its model FLOPs, trainer/flops.py, ÷ the GPU's dense bf16 peak or `--peak-tflops`; null on a CPU),
peak_mem_gb (CUDA: peak allocated over the run; CPU: peak RSS), ratio_to_bare, and with both
attentions speedup_flash_vs_local and tokens_per_s_flash.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def response_lengths(*, batch: int, mean: float, sigma: float, max_len: int, max_ratio: float,
                     seed: int) -> list[int]:
    rng = random.Random(seed)
    mu = math.log(mean) - sigma ** 2 / 2  # lognormal with this mean
    lengths = [min(max_len, max(1, round(rng.lognormvariate(mu, sigma)))) for _ in range(batch)]
    longest = max(range(batch), key=lambda i: lengths[i])
    while max(lengths) < max_ratio * statistics.mean(lengths) and lengths[longest] < max_len:
        lengths[longest] = min(max_len, math.ceil(max_ratio * statistics.mean(lengths)) + 1)
    return lengths


def make_batch(lengths: list[int], *, prompt_len: int, vocab: int, seed: int) -> dict[str, Any]:
    import torch

    from megatron_flash.types import Sample, collate

    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i, n in enumerate(lengths):
        ids = torch.randint(1, vocab, (prompt_len + n,), generator=gen).tolist()
        samples.append(Sample(prompt_ids=ids[:prompt_len], response_ids=ids[prompt_len:],
                              behavior_logprobs=(-torch.rand(n, generator=gen) * 3).tolist(),
                              reward=float(i % 2), group_id=i // 8))
    adv = torch.randn(len(samples), generator=gen)
    return collate(samples, pad_id=0, advantages=adv)


def bare_step(policy: Any, micro: list[Any]) -> None:
    """Megatron's schedule over prepared micro-batches with a trivial loss, then the optimizer step."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def loss_func(output: torch.Tensor) -> Any:
        return output.float().sum() * 1e-9, torch.tensor(output.shape[1], dtype=torch.int), {}

    def forward_step(data: Any, model: Any) -> Any:
        m = next(data)
        return model(m.tokens, m.positions, attention_mask=None,
                     packed_seq_params=m.packed_seq_params), loss_func

    for chunk in policy.chunks:
        chunk.zero_grad_buffer()
    policy.optimizer.zero_grad()
    chunks = policy.chunks
    data = [iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro)
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data, model=chunks,
                                num_microbatches=len(micro), seq_length=micro[0].row_len,
                                micro_batch_size=1, forward_only=False)
    policy.optimizer.step()


PRESETS = {  # Qwen2.5 shapes: --arch, layers, hidden, heads, KV heads, MLP width, vocabulary
    "0.5b": ("qwen2", 24, 896, 14, 2, 4864, 151936),
    "1.5b": ("qwen2", 28, 1536, 12, 2, 8960, 151936),
}


def set_attention(policy: Any, kind: str) -> None:
    """Switch every core-attention module of the policy between the per-sample local class and the
    flash class (same parameters: core attention has none)."""
    from megatron_flash.trainer.flash_attention import flash_dot_product_attention
    from megatron_flash.trainer.packed_attention import packed_dot_product_attention

    local, flash = packed_dot_product_attention(), flash_dot_product_attention()
    for chunk in policy.chunks:
        for mod in chunk.modules():
            if isinstance(mod, (local, flash)) and type(mod) in (local, flash):
                if kind == "flash":
                    scaling = getattr(mod.config, "apply_query_key_layer_scaling", False)
                    mod.flash_scale = float(mod.softmax_scale) * (mod.layer_number if scaling else 1)
                mod.__class__ = flash if kind == "flash" else local


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="", help="a HF checkpoint (default: build one with the sizes below)")
    p.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3", "qwen3_moe"],
                   help="family of the built checkpoint (qwen3_moe: 8 experts, top-2, expert FFN = hidden)")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=32, help="samples per optimizer step")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--mean-len", type=float, default=96.0, help="mean response length (tokens)")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal σ of response lengths")
    p.add_argument("--max-len", type=int, default=2048, help="longest response allowed (tokens)")
    p.add_argument("--max-ratio", type=float, default=6.0, help="stretch the tail until max/mean ≥ this")
    p.add_argument("--padded-micro-batch", type=int, default=4, help="(a): samples per padded micro-batch")
    p.add_argument("--max-tokens", type=int, default=0, help="(b): token budget (default: the longest sample)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps per mode and round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="per GPU, for mfu (default: the GPU's dense bf16 peak, trainer/flops.PEAK_BF16)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="cuda: fail unless CUDA is there; cpu: hide CUDA")
    p.add_argument("--preset", default="", choices=["", *PRESETS], help="a Qwen2.5-shaped model and batch (above)")
    p.add_argument("--attention", default="auto", choices=["auto", "local", "flash", "both"],
                   help="packed way's core attention (auto: both on CUDA in bf16/fp16, local otherwise)")
    p.add_argument("--shared-prefix", action="store_true",
                   help="instead: groups sharing a prompt, trained with and without trainer.shared_prefix "
                        "(benchmarks/shared_prefix_bench.py; --prompt-len, --response-len, --group-size)")
    p.add_argument("--response-len", type=int, default=32, help="--shared-prefix: tokens of every response")
    p.add_argument("--group-size", type=int, default=8, help="--shared-prefix: responses per prompt")
    p.add_argument("--memory", action="store_true", help="--shared-prefix: peak memory of each layout (own process)")
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.preset:
        arch, layers, hidden, heads, kv, ffn, vocab = PRESETS[args.preset]
        args.arch, args.num_layers, args.hidden_size, args.dtype = arch, layers, hidden, "bfloat16"
        if not args.shared_prefix:  # --shared-prefix keeps its own batch shape
            args.batch, args.prompt_len, args.mean_len, args.max_len, args.max_ratio = 16, 64, 1000.0, 8192, 8.0
        args.max_tokens = args.max_tokens or 16384
        shape = ["--num-heads", str(heads), "--num-kv-heads", str(kv), "--intermediate-size", str(ffn),
                 "--vocab-size", str(vocab)]
    else:
        shape = []

    import torch
    import warnings

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    cuda = torch.cuda.is_available()
    attention = args.attention
    if attention == "auto":
        attention = "both" if cuda and args.dtype != "float32" else "local"

    warnings.filterwarnings("ignore")
    from megatron_flash.config.schema import OptimizerConfig
    from megatron_flash.losses import get_loss
    from megatron_flash.trainer.distributed import destroy_distributed
    from megatron_flash.trainer.flops import peak_flops, train_flops
    from megatron_flash.trainer.loss_adapter import make_loss_fn
    from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings
    from megatron_flash.types import compact_routes

    model = args.model_path
    if not model:
        model = os.path.join(tempfile.mkdtemp(prefix="mf_trainer_tp_"), "model")
        subprocess.run([sys.executable, os.path.join(REPO, "tools/make_tiny_model.py"), "--out", model,
                        "--arch", args.arch, "--hidden-size", str(args.hidden_size), "--num-layers", str(args.num_layers),
                        *shape],
                       check=True, stdout=subprocess.DEVNULL)
    if args.shared_prefix:
        import shared_prefix_bench

        return shared_prefix_bench.main(args, lambda: MegatronPolicy(PolicySettings(
            hf_path=model, dtype=args.dtype, optimizer=OptimizerConfig(lr=1e-7),
            attention_backend="local" if attention == "local" else "flash")))
    lengths = response_lengths(batch=args.batch, mean=args.mean_len, sigma=args.sigma, max_len=args.max_len,
                               max_ratio=args.max_ratio, seed=args.seed)
    totals = [args.prompt_len + n for n in lengths]
    budget = args.max_tokens or max(totals)
    policy = MegatronPolicy(PolicySettings(hf_path=model, dtype=args.dtype, micro_batch_size=args.padded_micro_batch,
                                           pack_sequences=False, optimizer=OptimizerConfig(lr=1e-7),
                                           attention_backend="local" if attention == "local" else "flash"))
    batch = make_batch(lengths, prompt_len=args.prompt_len, vocab=policy.spec.vocab_size, seed=args.seed)
    loss_fn = make_loss_fn(get_loss("tis"))
    real = sum(totals)

    def configure(pack: bool) -> list[Any]:
        s = policy.settings
        s.pack_sequences, s.micro_batch_size = pack, (len(totals) if pack else args.padded_micro_batch)
        s.max_tokens_per_micro_batch = budget if pack else 0
        return policy._micro_batches(batch)

    computed = {m: sum(x.tokens.numel() for x in configure(m == "packed")) for m in ("padded", "packed")}
    packed_micro = configure(True)

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def run(mode: str) -> float:
        if attention != "local":  # the padded way as before packing; bare over the fastest attention
            set_attention(policy, "flash" if mode in ("flash", "bare") and attention != "local" else "local")
        if mode == "bare":
            step = partial(bare_step, policy, packed_micro)
        else:
            configure(mode in ("packed", "flash", "replay"))
            if policy.routing is not None:
                policy.routing.replay = mode == "replay"
            step = partial(policy.train_step, routed if mode == "replay" else batch, loss_fn)
        step()  # warm-up (allocator, first-call costs)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        return (time.perf_counter() - t0) / args.steps

    seconds: dict[str, list[float]] = {"padded": [], "packed": [], "bare": []}
    if attention in ("flash", "both"):
        seconds = {"padded": [], "flash": [], "bare": []} if attention == "flash" else \
            {"padded": [], "packed": [], "flash": [], "bare": []}
    routed = None
    if policy.spec.moe is not None:
        m = policy.spec.moe
        gen = torch.Generator().manual_seed(args.seed)
        picks = torch.rand(*batch.tokens.shape, policy.spec.num_layers, m.num_experts, generator=gen)
        routes = compact_routes(picks.topk(m.top_k, dim=-1).indices.flatten(2))  # distinct experts per layer
        routed = batch.replace(routed_experts=routes)
        seconds["replay"] = []
    for r in range(args.rounds):
        for mode in seconds:
            seconds[mode].append(run(mode))
            print(f"[round {r}] {mode}: {seconds[mode][-1]:.3f} s/step", file=sys.stderr, flush=True)
    step_s = {m: statistics.mean(v) for m, v in seconds.items()}
    tps = {m: real / s for m, s in step_s.items()}
    if "packed" not in tps:  # --attention flash: the packed way is the flash one
        tps["packed"], step_s["packed"] = tps["flash"], step_s["flash"]
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "arch": policy.spec.family, "dtype": args.dtype, "hidden_size": policy.spec.hidden_size, "num_layers": policy.spec.num_layers,
        "batch": args.batch, "mean_response": statistics.mean(lengths), "max_response": max(lengths),
        "max_over_mean": max(lengths) / statistics.mean(lengths), "max_tokens_per_micro_batch": budget,
        "micro_batches_padded": len(configure(False)), "micro_batches_packed": len(packed_micro),
        "step_s": step_s, "rounds": seconds,
        "tokens_per_s_padded": tps["padded"], "tokens_per_s_packed": tps["packed"],
        "tokens_per_s_bare": tps["bare"], "speedup": tps["packed"] / tps["padded"],
        "ratio_to_bare": tps["packed"] / tps["bare"],
        "padding_frac_padded": 1.0 - real / computed["padded"],
        "padding_frac_packed": 1.0 - real / computed["packed"],
    }
    if "replay" in tps:
        out["tokens_per_s_replay"] = tps["replay"]
        out["replay_over_packed"] = tps["replay"] / tps["packed"]
    best = "flash" if "flash" in tps else "packed"
    peak = args.peak_tflops * 1e12 or peak_flops(out["device"] if cuda else None)
    out["attention"] = attention
    out["tokens_per_s"] = tps[best]
    out["ratio_to_bare"] = tps[best] / tps["bare"]
    out["model_tflops_per_gpu"] = train_flops(policy.spec, totals) / step_s[best] / 1e12
    out["mfu"] = out["model_tflops_per_gpu"] * 1e12 / peak if peak else None
    out["peak_mem_gb"] = (torch.cuda.max_memory_allocated() if cuda else
                          resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1e3) / 1e9
    if "flash" in tps:
        out["tokens_per_s_flash"] = tps["flash"]
        out["speedup_flash_vs_local"] = tps["flash"] / tps["packed"] if "packed" in tps else None
    destroy_distributed()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
