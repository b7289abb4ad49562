"""A long-response RL task on CPU under context parallelism: responses of more than 2k tokens.

    python benchmarks/long_response.py                       # 2048-token responses, CP2 on 2 trainer processes
    python benchmarks/long_response.py --cp 1 --out runs/long_response_cp1 --keep-warm   # the same at CP1

The task is sort4_long (megatron_flash/rewards/synthetic.py): the prompt "3142:" is answered by the
sorted digits first, in a response of at least `--response-tokens` tokens (reward `answer_first_long`:
the answer decides, the length is required). The engines end no response before that length
(rollout.min_new_tokens), so every trained sequence is over 2k tokens. (A 2-layer model cannot count to
2k at temperature 1: asked to think first and answer at the end, it ends anywhere from 200 to 2100
tokens, and placed after a forced length its answer is cut off; its reward stayed 0.) The stages are the
quickstart's (launch/quickstart_common.py):

  1. a tiny Llama (2 layers, hidden 64, char tokenizer, 4096 positions);
  2. a format-only warm-up at CP1: a random permutation of the prompt's digits, then filler '|', so the
     reward starts near chance (≈ 1/24): `--sft-steps` steps of 64 short responses (4–60 filler
     characters: the format), then `--sft-long-steps` steps of `--sft-batch` full ones (response_tokens
     + U[0, 32) characters: the filler at every position up to 2k);
  3. asynchronous RL (launch/pretrain_async_rl.py under torchrun, `--cp` processes,
     parallel.context_parallel_size=`--cp`, α = 2, the local engine server) on configs/quickstart_cpu.yaml
     with the task's overrides below.

The last line is one JSON summary: the reward's first and last 3-step means, the response lengths,
seconds per RL step, the tokens each CP rank computed per step, and the updates taken.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch"))
from quickstart_common import REPO, Quickstart, arg_parser  # noqa: E402
from quickstart_cpu import format_only_samples  # noqa: E402


def overrides(length: int, cp: int, steps: int) -> list[str]:
    longest = length + 64
    return ["data.task=sort4_long", f"data.task_args={{response_tokens: {length}}}",
            "rollout.reward=answer_first_long", f"rollout.max_new_tokens={longest}",
            f"rollout.min_new_tokens={length}",  # the engines end no response before it
            f"trainer.max_seq_len={longest + 16}", f"trainer.total_steps={steps}",
            # the local engine's KV slots hold prompt + response (its default context is 1024 tokens)
            f"engines.server_args.context_length={longest + 16}",
            # 8 prompts × 8 responses of ~2k tokens per step: 130k tokens, in micro-batches of 8 rows
            "trainer.global_batch_size=64", "trainer.micro_batch_size=8",
            f"parallel.context_parallel_size={cp}"]


def short_samples(task, tokenizer, rng: random.Random, size: int) -> list:
    """The format on short responses: a permutation of the digits, then 4–60 filler characters."""
    out = []
    for sample in format_only_samples(task, tokenizer, rng, size):
        keep = 4 + rng.randrange(4, 60)
        out.append(dataclasses.replace(sample, response_ids=sample.response_ids[:keep] + sample.response_ids[-1:],
                                       behavior_logprobs=sample.behavior_logprobs[:keep + 1]))  # then the end token
    return out


def long_warm_up(run: Quickstart, policy, task, tokenizer, rng: random.Random, args) -> float:
    """Continue the warm-up on full-length responses, then export over {out}/warm_model; the last nll."""
    from megatron_flash.trainer.loss_adapter import nll_loss_fn
    from megatron_flash.types import collate

    loss = float("nan")
    for step in range(1, args.sft_long_steps + 1):
        batch = collate(format_only_samples(task, tokenizer, rng, args.sft_batch), pad_id=tokenizer.pad_token_id)
        loss = policy.train_step(batch, nll_loss_fn)["loss"]
        if step % 10 == 0 or step == 1:
            run.log(f"warm-up (full length) step {step:3d}/{args.sft_long_steps}  nll/token {loss:.3f}")
    policy.export_hf(run.warm_path)
    return loss


def main() -> int:
    p = arg_parser(__doc__, out="runs/long_response", sft_steps=300)
    p.add_argument("--sft-long-steps", type=int, default=40, help="warm-up steps on full-length responses")
    p.add_argument("--sft-batch", type=int, default=4, help="full-length rows per step (~3 s each at 2k tokens)")
    p.add_argument("--response-tokens", type=int, default=2048)
    p.add_argument("--cp", type=int, default=2, help="context-parallel size = trainer processes")
    p.add_argument("--steps", type=int, default=20, help="RL steps")
    p.add_argument("--keep-warm", action="store_true", help="reuse {out}/warm_model when it is there")
    args = p.parse_args()
    from megatron_flash.rewards.synthetic import get_task

    task = get_task("sort4_long", {"response_tokens": args.response_tokens})
    run = Quickstart("long-response", out=args.out)
    tokenizer = run.tiny_model(seed=args.seed, flags=("--max-positions", "4096"))
    rng = random.Random(args.seed)

    nll = {}
    if args.keep_warm and os.path.isfile(os.path.join(run.warm_path, "config.json")):
        run.log(f"warm model kept: {run.warm_path}")
    else:
        warm = run.warm_up(seed=args.seed, num_steps=args.sft_steps, batch_size=64,
                           make_samples=lambda: short_samples(task, tokenizer, rng, 64),
                           pad_id=tokenizer.pad_token_id, loss_label="nll/token (short)", log_every=50)
        nll = warm.nll()
        nll["sft_long_nll_last"] = long_warm_up(run, warm.policy, task, tokenizer, rng, args)
    rows = run.rl(config=os.path.join(REPO, "configs/quickstart_cpu.yaml"), nproc=args.cp,
                  overrides=[*overrides(args.response_tokens, args.cp, args.steps), *args.overrides])
    rewards = [r["reward_mean"] for r in rows]
    lengths = [r["response_len_mean"] for r in rows]
    summary = {"task": "sort4_long", "response_tokens": args.response_tokens, "cp": args.cp, **nll,
               "rl_steps": len(rows), "reward_first3": sum(rewards[:3]) / 3, "reward_last3": sum(rewards[-3:]) / 3,
               "response_len_min_step_mean": min(lengths), "response_len_mean": sum(lengths) / len(lengths),
               "rl_seconds_per_step": sum(r["time_step"] for r in rows) / len(rows),
               "tokens_computed_per_rank": sum(r["train/tokens_computed"] for r in rows) / len(rows),
               "staleness_max": max(r["staleness_max"] for r in rows),
               "updates": sum(r["train/update_ok"] for r in rows),
               "mismatch_abs_mean": sum(r["train/mismatch_abs"] for r in rows) / len(rows),
               "rewards": [round(x, 4) for x in rewards], "metrics": run.metrics_path}
    run.finish(summary, hide="rewards",
               headline="CP{cp}, responses of {response_len_mean:.0f} tokens (shortest step mean "
                        "{response_len_min_step_mean:.0f}): reward {reward_first3:.3f} → {reward_last3:.3f} in "
                        "{rl_steps} steps ({updates:.0f} updates), {rl_seconds_per_step:.1f} s/step; {seconds} s total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
