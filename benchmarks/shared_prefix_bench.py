"""`benchmarks/trainer_throughput.py --shared-prefix`: one group-structured batch trained with and without
trainer.shared_prefix, side by side in one run.

    python benchmarks/trainer_throughput.py --shared-prefix --prompt-len 256 --response-len 32 --group-size 8
    python benchmarks/trainer_throughput.py --shared-prefix --prompt-len 256 --response-len 32 --memory --rounds 1

The batch: --batch samples in groups of --group-size; each group one random prompt of --prompt-len
tokens and its responses of --response-len tokens each (random ids; the tis loss through the product's
loss adapter, random advantages and behaviour logprobs). One policy trains it packed, alternately with
the shared prefix on and off (--rounds rounds of --steps timed steps after one warm-up step), the same
token budget (--max-tokens; default: the whole batch in one micro-batch).

Last line, one JSON object: `speedup` (step time unshared ÷ shared), `flop_ratio` (model FLOPs of the
unshared layout ÷ the shared one: trainer/flops.py, the matmuls over the tokens each layout computes plus
each one's attention pairs), `tokens_computed_ratio` (row tokens unshared ÷ shared), the step times per
round, peak_mem_gb (the process: CUDA peak allocated, CPU peak resident set), and with --memory the
activation memory of one step per layout (`activation_gb`: the bytes autograd saves for the backward,
each storage once: the forward's peak with the batch in one micro-batch) and `activation_ratio`.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any


def grouped_batch(*, batch: int, group_size: int, prompt_len: int, response_len: int, vocab: int, seed: int) -> Any:
    import torch

    from megatron_flash.types import Sample, collate

    gen = torch.Generator().manual_seed(seed)
    samples = []
    for g in range(batch // group_size):
        prompt = torch.randint(1, vocab, (prompt_len,), generator=gen).tolist()
        for i in range(group_size):
            samples.append(Sample(prompt_ids=prompt, response_ids=torch.randint(1, vocab, (response_len,), generator=gen).tolist(),
                                  behavior_logprobs=(-torch.rand(response_len, generator=gen) * 3).tolist(),
                                  reward=float(i % 2), group_id=g))
    return collate(samples, pad_id=0, advantages=torch.randn(len(samples), generator=gen))


def layout_flops(spec: Any, micro: list[Any]) -> float:
    """Model FLOPs of the rows these micro-batches run: 6·N per computed token (trainer/flops.py) and
    12·a·d per attention pair (query, key it sees) and layer, forward + backward."""
    from megatron_flash.trainer.flops import matmul_weights_per_token

    n = matmul_weights_per_token(spec)
    ad = spec.num_attention_heads * spec.head_dim
    tokens = pairs = 0
    for m in micro:
        real = m.real[0]
        tokens += int(real.sum())
        plan = getattr(m.packed_seq_params, "mf_local_plan", None)
        if plan is None:  # every sample causal on itself (the padding tail is no sample)
            cu = m.packed_seq_params.cu_seqlens_q.tolist()
            pairs += sum((b - a) * (b - a + 1) // 2 for a, b in zip(cu[:-1], cu[1:]) if b > a and real[a])
        else:
            for q_index, _, mask in plan:
                per = q_index.shape[0] * (q_index.shape[0] + 1) // 2 if mask is None else int((~mask).sum())
                pairs += per * int(real[q_index[0]].sum())
    return float(6 * n * tokens + 12 * ad * pairs * spec.num_layers)


def main(args: Any, policy_factory: Any) -> int:
    import torch

    from megatron_flash.losses import get_loss
    from megatron_flash.trainer.distributed import destroy_distributed
    from megatron_flash.trainer.loss_adapter import make_loss_fn

    if args.batch % args.group_size:
        raise SystemExit(f"--batch {args.batch} is not a multiple of --group-size {args.group_size}")
    policy = policy_factory()
    batch = grouped_batch(batch=args.batch, group_size=args.group_size, prompt_len=args.prompt_len,
                          response_len=args.response_len, vocab=policy.spec.vocab_size, seed=args.seed)
    loss_fn = make_loss_fn(get_loss("tis"))
    s = policy.settings
    s.pack_sequences, s.micro_batch_size, s.max_tokens_per_micro_batch = True, args.batch, args.max_tokens

    def micro(shared: bool) -> list[Any]:
        s.shared_prefix = shared
        return policy._micro_batches(batch)

    layouts = {"unshared": micro(False), "shared": micro(True)}
    flops = {k: layout_flops(policy.spec, v) for k, v in layouts.items()}
    computed = {k: sum(m.tokens.numel() for m in v) for k, v in layouts.items()}
    modes = ["unshared", "shared"]

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def run(mode: str) -> float:
        s.shared_prefix = mode == "shared"
        policy.train_step(batch, loss_fn)  # warm-up
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            policy.train_step(batch, loss_fn)
        sync()
        return (time.perf_counter() - t0) / args.steps

    seconds: dict[str, list[float]] = {m: [] for m in modes}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    for r in range(args.rounds):
        for mode in modes:
            seconds[mode].append(run(mode))
            print(f"[round {r}] {mode}: {seconds[mode][-1]:.3f} s/step", file=sys.stderr, flush=True)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "arch": policy.spec.family, "dtype": args.dtype, "hidden_size": policy.spec.hidden_size,
        "num_layers": policy.spec.num_layers, "batch": args.batch, "group_size": args.group_size,
        "prompt_len": args.prompt_len, "response_len": args.response_len,
        "p_over_r": args.prompt_len / args.response_len, "rounds": seconds,
        "flop_ratio": flops["unshared"] / flops["shared"],
        "tokens_computed_ratio": computed["unshared"] / computed["shared"],
        "tokens_computed": computed,
    }
    step = {m: statistics.mean(v) for m, v in seconds.items()}
    out["step_s"] = step
    out["speedup"] = step["unshared"] / step["shared"]
    out["speedup_over_flop_ratio"] = out["speedup"] / out["flop_ratio"]
    import resource

    out["peak_mem_gb"] = (torch.cuda.max_memory_allocated() if torch.cuda.is_available() else
                          resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1e3) / 1e9
    if getattr(args, "memory", False):
        saved = {}
        for mode in modes:
            s.shared_prefix = mode == "shared"
            saved[mode] = activation_bytes(policy, batch, loss_fn)
        out["activation_gb"] = {m: v / 1e9 for m, v in saved.items()}
        out["activation_ratio"] = saved["unshared"] / saved["shared"]
    destroy_distributed()
    print(json.dumps(out))
    return 0


def activation_bytes(policy: Any, batch: Any, loss_fn: Any) -> int:
    """Bytes of the tensors autograd keeps for the backward of one training step (each storage once):
    with the batch in one micro-batch, the forward's activation memory at its peak, on any device."""
    import torch

    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        policy.train_step(batch, loss_fn)
    return sum(seen.values())
