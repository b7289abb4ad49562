"""CPU quickstart: a tiny model, a format-only warm-up, then asynchronous RL that visibly learns.

    make quickstart                      # = OMP_NUM_THREADS=1 .venv/bin/python launch/quickstart_cpu.py
    python launch/quickstart_cpu.py --out runs/qs_tis loss.name=tis      # any config override
    python launch/quickstart_cpu.py --arch qwen3_moe --out runs/qs_moe trainer.moe_routing_replay=rollout
                                         # the same with the tiny Qwen3-MoE (8 experts, top-2), routes replayed

Stages (each prints progress; the last line is one JSON summary):
  1. tools/make_tiny_model.py   → {out}/tiny_model (Llama-style by default, 2 layers, hidden 64, char tokenizer)
  2. format-only warm-up        → Megatron SFT on sort4 answers that are *random permutations* of the
                                  input: the model learns the answer format, not the order, so the
                                  reward starts at chance (≈1/24)
  3. export → {out}/warm_model  → Megatron → HF safetensors; transformers reloads it and the logits
                                  are compared with Megatron's (parity check)
  4. asynchronous RL            → `launch/pretrain_async_rl.py --config configs/quickstart_cpu.yaml`
                                  (the product's entry point, as a subprocess): a local engine server
                                  generates over HTTP while Megatron trains, α = 2, weights pushed to
                                  the engine after every step; metrics in {out}/rl/metrics.jsonl
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any

from quickstart_common import REPO, Quickstart, arg_parser


def format_only_samples(task: Any, tokenizer: Any, rng: random.Random, size: int) -> list[Any]:
    """sort4 prompts answered with a random permutation of their input, then the end token."""
    from megatron_flash.types import Sample

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    samples = []
    for _ in range(size):
        prompt, _answer = task.make(rng)
        target = task.format_only(rng, prompt)
        response = encode(target) + [tokenizer.eos_token_id]
        samples.append(Sample(encode(prompt), response, [0.0] * len(response)))
    return samples


def export_parity(policy: Any, warm: str) -> float:
    """Max |Δlogit| between Megatron and transformers' reload of the export, on fixed random tokens."""
    import torch
    import transformers

    tokens = torch.randint(4, policy.spec.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    megatron_logits = policy.compute_logits(tokens).double()
    hf = transformers.AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32)
    with torch.no_grad():
        hf_logits = hf(tokens).logits.double()
    return (megatron_logits - hf_logits).abs().max().item()


def summarize(rows: list[dict[str, Any]], metrics_path: str) -> dict[str, Any]:
    rewards = [r["reward_mean"] for r in rows]
    return {"rl_steps": len(rows), "reward_first5": sum(rewards[:5]) / 5, "reward_last5": sum(rewards[-5:]) / 5,
            "staleness_mean": sum(r["staleness_mean"] for r in rows) / len(rows),
            "staleness_max": max(r["staleness_max"] for r in rows),
            "rl_seconds_per_step": sum(r["time_step"] for r in rows) / len(rows),
            "rewards": [round(r, 4) for r in rewards], "metrics": metrics_path}


def main() -> int:
    p = arg_parser(__doc__, out="runs/quickstart", sft_steps=300)
    p.add_argument("--arch", default="llama", choices=("llama", "qwen3_moe"), help="the tiny model's family")
    args = p.parse_args()
    from megatron_flash.rewards.synthetic import get_task

    task = get_task("sort4")
    run = Quickstart("quickstart", out=args.out)
    tokenizer = run.tiny_model(seed=args.seed, flags=("--arch", args.arch))
    rng = random.Random(args.seed)
    warm = run.warm_up(seed=args.seed, num_steps=args.sft_steps, batch_size=64,
                       make_samples=lambda: format_only_samples(task, tokenizer, rng, 64),
                       pad_id=tokenizer.pad_token_id, loss_label="nll/token", log_every=50)
    diff = export_parity(warm.policy, warm.path)
    run.log(f"exported {warm.path}; Megatron vs transformers max |Δlogit| = {diff:.2e}")
    summary = {"task": "sort4", "arch": args.arch, **warm.nll(), "export_max_abs_logit_diff": diff}
    rows = run.rl(config=os.path.join(REPO, "configs/quickstart_cpu.yaml"), overrides=args.overrides)
    summary.update(summarize(rows, run.metrics_path))
    run.finish(summary, hide="rewards",
               headline="reward: first-5-step mean {reward_first5:.3f} → last-5-step mean {reward_last5:.3f} in "
                        "{rl_steps} async RL steps (staleness mean {staleness_mean:.2f}, max {staleness_max}); "
                        "{seconds} s total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
