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
                                  (the product's entry point, as a subprocess): a CPU engine server
                                  generates over HTTP while Megatron trains, α = 2, weights pushed to
                                  the engine after every step; metrics in {out}/rl/metrics.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
warnings.filterwarnings("ignore")

import torch  # noqa: E402

torch.set_num_threads(1)


def log(msg: str) -> None:
    print(f"[quickstart {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def sft_batch(task, tokenizer, rng: random.Random, size: int) -> dict[str, torch.Tensor]:
    from megatron_flash.types import Sample, collate

    samples = []
    for _ in range(size):
        prompt, _answer = task.make(rng)
        target = task.format_only(rng, prompt)
        response = encode(tokenizer, target) + [tokenizer.eos_token_id]
        samples.append(Sample(encode(tokenizer, prompt), response, [0.0] * len(response)))
    return collate(samples, pad_id=tokenizer.pad_token_id)


def warm_up(args, tokenizer, task) -> dict:
    from megatron_flash.config.schema import OptimizerConfig
    from megatron_flash.trainer.loss_adapter import nll_loss_fn
    from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings

    policy = MegatronPolicy(PolicySettings(hf_path=os.path.join(args.out, "tiny_model"), micro_batch_size=64,
                                           seed=args.seed, optimizer_steps=args.sft_steps,
                                           optimizer=OptimizerConfig(lr=1e-3, clip_grad=1.0)))
    rng = random.Random(args.seed)
    losses = []
    for step in range(1, args.sft_steps + 1):
        metrics = policy.train_step(sft_batch(task, tokenizer, rng, 64), nll_loss_fn)
        losses.append(metrics["loss"])
        if step % 50 == 0 or step == 1:
            log(f"warm-up step {step:4d}/{args.sft_steps}  nll/token {metrics['loss']:.3f}")
    warm = os.path.join(args.out, "warm_model")
    policy.export_hf(warm)
    tokens = torch.randint(4, policy.spec.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    megatron_logits = policy.compute_logits(tokens).double()
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32)
    with torch.no_grad():
        hf_logits = hf(tokens).logits.double()
    diff = (megatron_logits - hf_logits).abs().max().item()
    log(f"exported {warm}; Megatron vs transformers max |Δlogit| = {diff:.2e}")
    return {"sft_nll_first": losses[0], "sft_nll_last": sum(losses[-10:]) / 10, "export_max_abs_logit_diff": diff}


def rl(args, overrides: list[str]) -> dict:
    run_dir = os.path.join(args.out, "rl")
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics_path):
        os.remove(metrics_path)  # one run's curve, not an append of several
    cmd = [sys.executable, os.path.join(REPO, "launch/pretrain_async_rl.py"), "--config",
           os.path.join(REPO, "configs/quickstart_cpu.yaml"), f"model.hf_path={os.path.join(args.out, 'warm_model')}",
           f"logging.dir={run_dir}", *overrides]
    log("RL: " + " ".join(cmd[1:]))
    # The warm-up's single-process group left MASTER_PORT & co. in os.environ: the RL run picks its own.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                            "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    proc = subprocess.run(cmd, env={**env, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"quickstart: the RL run failed (exit {proc.returncode}); see the output above")
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rewards = [r["reward_mean"] for r in rows]
    return {"rl_steps": len(rows), "reward_first5": sum(rewards[:5]) / 5, "reward_last5": sum(rewards[-5:]) / 5,
            "staleness_mean": sum(r["staleness_mean"] for r in rows) / len(rows),
            "staleness_max": max(r["staleness_max"] for r in rows),
            "rl_seconds_per_step": sum(r["time_step"] for r in rows) / len(rows),
            "rewards": [round(r, 4) for r in rewards], "metrics": metrics_path}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/quickstart")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--arch", default="llama", choices=("llama", "qwen3_moe"), help="the tiny model's family")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for the RL run")
    args = p.parse_args()
    from megatron_flash.rewards.synthetic import get_task

    task = get_task("sort4")
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    tiny = os.path.join(args.out, "tiny_model")
    if not os.path.isfile(os.path.join(tiny, "config.json")):
        subprocess.run([sys.executable, os.path.join(REPO, "tools/make_tiny_model.py"), "--out", tiny,
                        "--seed", str(args.seed), "--arch", args.arch], check=True, capture_output=True)
    log(f"tiny model at {tiny}")
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    summary = {"task": "sort4", "arch": args.arch}
    summary.update(warm_up(args, tokenizer, task))
    from megatron_flash.trainer.distributed import destroy_distributed

    destroy_distributed()  # the RL run is its own process (its own process group and engines)
    summary.update(rl(args, args.overrides))
    summary["seconds"] = round(time.time() - t0, 1)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    log(f"reward: first-5-step mean {summary['reward_first5']:.3f} → last-5-step mean "
        f"{summary['reward_last5']:.3f} in {summary['rl_steps']} async RL steps (staleness mean "
        f"{summary['staleness_mean']:.2f}, max {summary['staleness_max']}); {summary['seconds']} s total")
    print(json.dumps({k: v for k, v in summary.items() if k != "rewards"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
