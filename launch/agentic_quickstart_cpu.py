"""Agentic quickstart on CPU: a tiny model plays multi-turn FrozenLake through the async controller.

    OMP_NUM_THREADS=1 .venv/bin/python launch/agentic_quickstart_cpu.py
    python launch/agentic_quickstart_cpu.py --out runs/aq_cispo loss.name=cispo trainer.total_steps=80
    python launch/agentic_quickstart_cpu.py --sft-steps 0 ...      # skip the warm-up (random model)

Stages (each prints progress; the last line is one JSON summary):
  1. tools/make_tiny_model.py  → {out}/tiny_model (Llama-style, 2 layers, hidden 64, char tokenizer)
  2. format-only warm-up       → Megatron SFT on whole episodes played with *random valid actions*
                                  (`random_valid_action` of the env class), tokenised exactly as the
                                  env manager does (`ChatTokens`: first prompt, a0 </s> o1 a1 </s> ...),
                                  loss on the action tokens only (`Sample.response_mask`). The model
                                  learns to answer one of l/r/u/d + end, not where to go: it starts
                                  at the random-walk success rate. Exported to {out}/warm_model.
  3. agentic RL                → `launch/pretrain_async_rl.py --config configs/agentic_frozenlake_cpu.yaml
                                  model.hf_path={out}/warm_model` (the product's entry point, as a
                                  subprocess): env-level async episodes against a local engine server,
                                  α = 2, weights pushed after every step; metrics in {out}/rl/metrics.jsonl
  4. summary                   → success rate and reward over the first 5 vs the last 5 steps, next to
                                  the exact success rate of a uniformly random walk on the same maps.

Any `key=value` after the options overrides the config for both the warm-up layout and the RL run.
Measured (docs/agentic.md, "Training on CPU"): on the config's fixed set of 8 maps the success rate
goes from the random-walk level (0.13-0.19 in the first steps; random walk 0.153) to 0.44 (last 5
steps) in 150 steps, ~5 min on 2 cores; on fresh random maps (`agentic.num_seeds=0`) this 2-layer
model stays at the random-walk level: it does not generalise map-conditioned moves from the episode
reward in minutes.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import random
import shutil
import sys
from typing import Any

from quickstart_common import REPO, Quickstart, arg_parser

CONFIG = os.path.join(REPO, "configs/agentic_frozenlake_cpu.yaml")
WARM_UP_SEED_OFFSET = 1_000_000  # warm-up maps never coincide with the RL run's env seeds


# ---------------------------------------------------------------------------------------- warm-up
def random_episode(env: Any, chat: Any, agentic: Any, *, seed: int, max_seq_len: int,
                   rng: random.Random) -> Any:
    """One episode of random valid actions as a `Sample` in the env manager's token layout.

    Mirrors EnvGroupRunner._turns: the same budget (min(max_episode_tokens, max_seq_len − prompt − 1)),
    actions as the model would emit them (text + end token, mask 1), observations as the template's
    delta (mask 0), and the same stopping rules (done, max_turns, no room for the next observation).
    """
    from megatron_flash.types import Sample

    prompt_ids, messages = chat.first(env.reset(seed))
    budget = min(agentic.max_episode_tokens, max_seq_len - len(prompt_ids) - 1)
    ids: list[int] = []
    mask: list[int] = []
    for _turn in range(agentic.max_turns):
        action = env.random_valid_action(rng)
        action_ids = chat.encode(action) + [chat.eos_id]
        if len(action_ids) > min(agentic.max_tokens_per_turn, budget - len(ids)):
            raise ValueError(f"agentic.max_tokens_per_turn={agentic.max_tokens_per_turn} cannot hold the "
                             f"action {action!r} and the end token ({len(action_ids)} tokens)")
        ids += action_ids
        mask += [1] * len(action_ids)
        result = env.step(action)
        if result.done:
            break
        obs_ids, messages = chat.observation(messages, action, result.observation)
        if len(ids) + len(obs_ids) >= budget:
            break
        ids += obs_ids
        mask += [0] * len(obs_ids)
    return Sample(list(prompt_ids), ids, [0.0] * len(ids), response_mask=mask)


def random_episodes(cfg: Any, tokenizer: Any, *, seed: int, batch_size: int) -> Any:
    """A `make_samples` for the warm-up: each call, `batch_size` random episodes on fresh maps."""
    from megatron_flash.agentic import make_env, unwrap
    from megatron_flash.agentic.env_manager import ChatTokens

    agentic = cfg.agentic
    env = unwrap(make_env(agentic.env, **dict(agentic.env_params)))  # the SyncEnv, called directly
    chat = ChatTokens(tokenizer, system_prompt=agentic.system_prompt)
    rng = random.Random(seed)
    seeds = itertools.count(WARM_UP_SEED_OFFSET)
    return lambda: [random_episode(env, chat, agentic, seed=next(seeds), max_seq_len=cfg.trainer.max_seq_len,
                                   rng=rng) for _ in range(batch_size)]


# ---------------------------------------------------------------------------------------- baseline
def random_walk_success(cfg: Any, seeds: range) -> float:
    """Exact success probability of a uniformly random l/r/u/d walk, averaged over the env seeds.

    Expands every branch of up to max_turns moves on each map (at most 4^5 = 1024 leaves here), so
    the number is the expectation, not a sample. Branches copy the env (`copy.copy`): FrozenLake's
    state (player cell, step count, done) is replaced, never mutated, on a non-slippery step.
    """
    from megatron_flash.agentic import make_env, unwrap

    params = dict(cfg.agentic.env_params)
    if params.get("slippery"):
        raise ValueError("the exact random-walk baseline assumes deterministic moves (slippery=false)")
    env = unwrap(make_env(cfg.agentic.env, **params))

    def p_success(state: Any, turns_left: int) -> float:
        total = 0.0
        for action in "lrud":
            branch = copy.copy(state)
            result = branch.step(action)
            if result.info.get("success"):
                total += 1.0
            elif not result.done and turns_left > 1:
                total += p_success(branch, turns_left - 1)
        return total / 4

    rates = []
    for seed in seeds:
        env.reset(seed)
        rates.append(p_success(env, cfg.agentic.max_turns))
    return sum(rates) / len(rates)


# ---------------------------------------------------------------------------------------- summary
def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def mean(key: str, part: list[dict[str, Any]]) -> float:
        values = [r[key] for r in part if r.get(key) is not None]
        return round(sum(values) / len(values), 4) if values else float("nan")

    first, last = rows[:5], rows[-5:]
    out: dict[str, Any] = {"rl_steps": len(rows)}
    for key, name in (("env/success_rate", "success"), ("reward_mean", "reward"),
                      ("env/invalid_actions", "invalid_actions"), ("env/turns_mean", "turns"),
                      ("response_len_mean", "action_tokens")):
        out[f"{name}_first5"] = mean(key, first)
        out[f"{name}_last5"] = mean(key, last)
    out["staleness_mean"] = mean("staleness_mean", rows)
    out["staleness_max"] = max(r["staleness_max"] for r in rows)
    out["env_errors"] = sum(r.get("env/errors", 0) for r in rows)
    out["rl_seconds_per_step"] = mean("time_step", rows)
    out["success_per_step"] = [round(r.get("env/success_rate", float("nan")), 3) for r in rows]
    return out


def main() -> int:
    p = arg_parser(__doc__, out="runs/agentic_quickstart", sft_steps=150,
                   sft_steps_help="warm-up optimizer steps (0 = none)", overrides_help="config overrides")
    p.add_argument("--sft-batch", type=int, default=32, help="episodes per warm-up step")
    args = p.parse_args()
    from megatron_flash.config import load_config

    cfg = load_config(CONFIG, args.overrides)
    run = Quickstart("agentic quickstart", out=args.out)
    tokenizer = run.tiny_model(seed=args.seed)
    summary: dict[str, Any] = {"env": cfg.agentic.env, "env_params": dict(cfg.agentic.env_params)}
    if args.sft_steps > 0:
        note = f" (uniform over 4 letters, end token certain: {0.5 * math.log(4.0):.3f})"
        warm = run.warm_up(seed=args.seed, num_steps=args.sft_steps, batch_size=args.sft_batch,
                           make_samples=random_episodes(cfg, tokenizer, seed=args.seed, batch_size=args.sft_batch),
                           pad_id=tokenizer.pad_token_id, loss_label="nll per action token", log_every=25,
                           loss_note=note)
        run.log(f"exported {warm.path}")
        summary.update({"sft_steps": args.sft_steps, **warm.nll()})
    else:
        shutil.copytree(run.tiny_path, run.warm_path, dirs_exist_ok=True)
    rows = run.rl(config=CONFIG, overrides=args.overrides)
    summary.update(summarize(rows))
    groups_per_step = cfg.trainer.global_batch_size * cfg.trainer.num_mini_batches // cfg.rollout.n_samples_per_prompt
    seeds = range(cfg.agentic.seed, cfg.agentic.seed + len(rows) * groups_per_step)
    summary["random_walk_success"] = round(random_walk_success(cfg, seeds), 4)
    run.finish(summary, hide="success_per_step",
               headline="success rate: first-5-step mean {success_first5:.3f} → last-5-step mean {success_last5:.3f} "
                        "in {rl_steps} async RL steps (random walk on the same maps: {random_walk_success:.3f}); "
                        "{seconds} s total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
