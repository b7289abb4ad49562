"""CPU quickstart: a tiny model, Megatron-Core on gloo, a supervised warm-up and RL that visibly learns.

    make quickstart                      # = OMP_NUM_THREADS=1 .venv/bin/python launch/quickstart_cpu.py
    python launch/quickstart_cpu.py --loss tis --rl-steps 150 --out runs/qs_tis

Stages (each prints progress; the last line is one JSON summary):
  1. tools/make_tiny_model.py   → {out}/tiny_model (Llama-style, 2 layers, hidden 64, char tokenizer)
  2. format-only warm-up        → Megatron SFT on sort4 answers that are *random permutations* of the
                                  input: the model learns the answer format, not the order, so the
                                  reward starts at chance (≈1/24)
  3. export → {out}/warm_model  → Megatron → HF safetensors; transformers reloads it and the logits
                                  are compared with Megatron's (parity check)
  4. synchronous GRPO            → the policy samples its own responses (no engine yet: the async
                                  pipeline with engines is issue 6), exact-match reward, GRPO
                                  advantages, the loss picked by name (--loss), Adam, grad-clip 1.0
Stops RL early once the mean reward of the last 5 steps reaches --target.
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
                                           seed=args.seed, total_steps=args.sft_steps,
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


def grpo(args, tokenizer, task) -> dict:
    from megatron_flash.config.schema import OptimizerConfig
    from megatron_flash.losses import compute_advantages, get_loss
    from megatron_flash.rewards.synthetic import exact_match_reward
    from megatron_flash.trainer.loss_adapter import make_loss_fn
    from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings
    from megatron_flash.trainer.sampling import sample
    from megatron_flash.types import Sample, collate

    policy = MegatronPolicy(PolicySettings(hf_path=os.path.join(args.out, "warm_model"), micro_batch_size=64,
                                           seed=args.seed + 1, total_steps=args.rl_steps,
                                           optimizer=OptimizerConfig(lr=1e-3, clip_grad=1.0)))
    loss = get_loss(args.loss)
    loss_fn = make_loss_fn(loss, aggregation="token_mean")
    rng = random.Random(args.seed + 2)
    gen = torch.Generator().manual_seed(args.seed + 3)
    rewards_per_step = []
    for step in range(1, args.rl_steps + 1):
        pairs = [task.make(rng) for _ in range(args.prompts)]
        prompts = [encode(tokenizer, p) for p, _ in pairs for _ in range(args.n)]
        outs = sample(policy, prompts, max_new_tokens=8, eos_id=tokenizer.eos_token_id,
                      pad_id=tokenizer.pad_token_id, temperature=1.0, generator=gen)
        samples = []
        for i, o in enumerate(outs):
            answer = pairs[i // args.n][1]
            body = o.response_ids[:-1] if o.finished else o.response_ids
            text = tokenizer.decode(body)
            samples.append(Sample(o.prompt_ids, o.response_ids, o.behavior_logprobs,
                                  reward=exact_match_reward(text, answer, finished=o.finished), group_id=i // args.n))
        rewards = torch.tensor([s.reward for s in samples])
        adv = compute_advantages("grpo", rewards=rewards, group_ids=torch.tensor([s.group_id for s in samples]))
        batch = collate(samples, pad_id=tokenizer.pad_token_id, advantages=adv)
        if loss.needs_proximal:  # one optimizer step per batch: π_prox is the sampling policy itself
            batch["proximal_logprobs"] = policy.compute_logprobs(batch)[0] * batch["loss_mask"]
        metrics = policy.train_step(batch, loss_fn)
        rewards_per_step.append(rewards.mean().item())
        if step % 10 == 0 or step == 1:
            log(f"rl step {step:4d}  reward {rewards_per_step[-1]:.3f}  (last-5 mean "
                f"{sum(rewards_per_step[-5:]) / len(rewards_per_step[-5:]):.3f})  loss {metrics['loss']:+.4f}")
        if len(rewards_per_step) >= 10 and sum(rewards_per_step[-5:]) / 5 >= args.target:
            break
    first5 = sum(rewards_per_step[:5]) / 5
    last5 = sum(rewards_per_step[-5:]) / 5
    return {"loss": args.loss, "rl_steps": len(rewards_per_step), "reward_first5": first5, "reward_last5": last5,
            "rewards": [round(r, 4) for r in rewards_per_step]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/quickstart")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--rl-steps", type=int, default=300)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8, help="responses per prompt (GRPO group size)")
    p.add_argument("--loss", default="ppo", help="any registered loss: ppo, decoupled_ppo, tis, cispo, topr, reinforce")
    p.add_argument("--target", type=float, default=0.8)
    args = p.parse_args()
    from megatron_flash.losses import get_loss
    from megatron_flash.rewards.synthetic import get_task

    get_loss(args.loss)  # an unknown name fails here, listing the known ones
    task = get_task("sort4")
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    tiny = os.path.join(args.out, "tiny_model")
    if not os.path.isfile(os.path.join(tiny, "config.json")):
        subprocess.run([sys.executable, os.path.join(REPO, "tools/make_tiny_model.py"), "--out", tiny,
                        "--seed", str(args.seed)], check=True, capture_output=True)
    log(f"tiny model at {tiny}")
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    summary = {"task": "sort4"}
    summary.update(warm_up(args, tokenizer, task))
    summary.update(grpo(args, tokenizer, task))
    summary["seconds"] = round(time.time() - t0, 1)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    log(f"reward: first-5-step mean {summary['reward_first5']:.3f} → last-5-step mean "
        f"{summary['reward_last5']:.3f} in {summary['rl_steps']} RL steps; {summary['seconds']} s total")
    print(json.dumps({k: v for k, v in summary.items() if k != "rewards"}))
    from megatron_flash.trainer.distributed import destroy_distributed

    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
