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
                                  subprocess): env-level async episodes against a CPU engine server,
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

import argparse
import copy
import itertools
import json
import os
import random
import subprocess
import sys
import time
import warnings
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
warnings.filterwarnings("ignore")

import torch  # noqa: E402

torch.set_num_threads(1)

CONFIG = os.path.join(REPO, "configs/agentic_frozenlake_cpu.yaml")
WARM_UP_SEED_OFFSET = 1_000_000  # warm-up maps never coincide with the RL run's env seeds


def log(msg: str) -> None:
    print(f"[agentic-quickstart {time.strftime('%H:%M:%S')}] {msg}", flush=True)


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


def warm_up(args: argparse.Namespace, cfg: Any, tokenizer: Any) -> dict[str, Any]:
    from megatron_flash.agentic import make_env, unwrap
    from megatron_flash.agentic.env_manager import ChatTokens
    from megatron_flash.config.schema import OptimizerConfig
    from megatron_flash.trainer.loss_adapter import nll_loss_fn
    from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings
    from megatron_flash.types import collate

    agentic = cfg.agentic
    env = unwrap(make_env(agentic.env, **dict(agentic.env_params)))  # the SyncEnv, called directly
    chat = ChatTokens(tokenizer, system_prompt=agentic.system_prompt)
    policy = MegatronPolicy(PolicySettings(hf_path=os.path.join(args.out, "tiny_model"),
                                           micro_batch_size=args.sft_batch, seed=args.seed,
                                           optimizer_steps=args.sft_steps,
                                           optimizer=OptimizerConfig(lr=1e-3, clip_grad=1.0)))
    rng = random.Random(args.seed)
    seeds = itertools.count(WARM_UP_SEED_OFFSET)
    losses = []
    for step in range(1, args.sft_steps + 1):
        samples = [random_episode(env, chat, agentic, seed=next(seeds), max_seq_len=cfg.trainer.max_seq_len,
                                  rng=rng) for _ in range(args.sft_batch)]
        batch = collate(samples, pad_id=tokenizer.pad_token_id)
        metrics = policy.train_step(batch, nll_loss_fn)
        losses.append(metrics["loss"])
        if step % 25 == 0 or step == 1:
            log(f"warm-up step {step:4d}/{args.sft_steps}  nll per action token {metrics['loss']:.3f} "
                f"(uniform over 4 letters, end token certain: {0.5 * torch.log(torch.tensor(4.0)).item():.3f})")
    warm = os.path.join(args.out, "warm_model")
    policy.export_hf(warm)
    log(f"exported {warm}")
    tail = losses[-10:]
    return {"sft_steps": args.sft_steps, "sft_nll_first": losses[0], "sft_nll_last": sum(tail) / len(tail)}


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


# ---------------------------------------------------------------------------------------- RL
def rl(args: argparse.Namespace, cfg: Any, overrides: list[str]) -> list[dict[str, Any]]:
    run_dir = os.path.join(args.out, "rl")
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics_path):
        os.remove(metrics_path)  # one run's curve, not an append of several
    cmd = [sys.executable, os.path.join(REPO, "launch/pretrain_async_rl.py"), "--config", CONFIG,
           f"model.hf_path={os.path.join(args.out, 'warm_model')}", f"logging.dir={run_dir}", *overrides]
    log("RL: " + " ".join(cmd[1:]))
    # The warm-up's single-process group left MASTER_PORT & co. in os.environ: the RL run picks its own.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                            "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    proc = subprocess.run(cmd, env={**env, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"agentic quickstart: the RL run failed (exit {proc.returncode}); see the output above")
    with open(metrics_path) as f:
        return [json.loads(line) for line in f if line.strip()]


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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/agentic_quickstart")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-steps", type=int, default=150, help="warm-up optimizer steps (0 = none)")
    p.add_argument("--sft-batch", type=int, default=32, help="episodes per warm-up step")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    args = p.parse_args()
    from megatron_flash.config import load_config

    cfg = load_config(CONFIG, args.overrides)
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    tiny = os.path.join(args.out, "tiny_model")
    if not os.path.isfile(os.path.join(tiny, "config.json")):
        subprocess.run([sys.executable, os.path.join(REPO, "tools/make_tiny_model.py"), "--out", tiny,
                        "--seed", str(args.seed)], check=True, capture_output=True)
    log(f"tiny model at {tiny}")
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    summary: dict[str, Any] = {"env": cfg.agentic.env, "env_params": dict(cfg.agentic.env_params)}
    if args.sft_steps > 0:
        summary.update(warm_up(args, cfg, tokenizer))
        from megatron_flash.trainer.distributed import destroy_distributed

        destroy_distributed()  # the RL run is its own process (its own process group and engines)
    else:
        import shutil

        shutil.copytree(tiny, os.path.join(args.out, "warm_model"), dirs_exist_ok=True)
    rows = rl(args, cfg, args.overrides)
    summary.update(summarize(rows))
    groups_per_step = cfg.trainer.global_batch_size * cfg.trainer.num_mini_batches // cfg.rollout.n_samples_per_prompt
    seeds = range(cfg.agentic.seed, cfg.agentic.seed + len(rows) * groups_per_step)
    summary["random_walk_success"] = round(random_walk_success(cfg, seeds), 4)
    summary["seconds"] = round(time.time() - t0, 1)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    log(f"success rate: first-5-step mean {summary['success_first5']:.3f} → last-5-step mean "
        f"{summary['success_last5']:.3f} in {summary['rl_steps']} async RL steps (random walk on the same "
        f"maps: {summary['random_walk_success']:.3f}); {summary['seconds']} s total")
    print(json.dumps({k: v for k, v in summary.items() if k != "success_per_step"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
