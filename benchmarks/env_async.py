"""Env-level async (the product's EnvGroupRunner) vs batch env stepping, and redundant env rollout.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/env_async.py        # defaults below, ~4 min on the CPU box
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/env_async.py --mu-ms 20,100,300,1000 --pool all --repeats 3
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/env_async.py --mu-ms 300 --redundancy 0   # one point, ~2 min

One local engine server (`python -m megatron_flash.engines.local_server`, the random tiny Llama of
tools/make_tiny_model.py, 1 thread) behind one LLMProxy. The environment is FixedTurnsEnv below: every
episode lasts exactly --turns steps whatever the model says, and every model turn is exactly
--tokens-per-turn tokens (ignore_eos), so all modes do identical work: the same episodes, the same
model tokens, the same observations and the same env delays (each episode's LatencyEnv is seeded by
(env seed, episode index), as the product seeds it); the run asserts equal episodes, turns and model
tokens. A frozenlake episode would end when the random model walks into a hole, so the modes would
play different episodes of different lengths.

Part 1, env-level async vs batch env stepping, for each μ in --mu-ms (default 100,300; env step
latency normal(μ, σ = μ) clipped at 0, mean ≈ 1.08 μ). --groups (64) groups of --group-size (4)
episodes of --turns (8) turns, --concurrent-groups (16) groups = 64 env instances at a time:

  batch   written here: the episodes of --concurrent-groups groups act together; each turn generates
          the actions of all live episodes (concurrently, through the same proxy), waits for all,
          steps all envs concurrently, waits for the slowest, then the next turn; the next
          --concurrent-groups groups start when every episode of the step is done.
  async   the product: EnvGroupRunner.run_group, each episode its own asyncio task (generate through
          the proxy, step, repeat); a new group starts the moment one lands, as the product's
          scheduler admits a group when a landed one frees capacity (a finished episode's env
          instance waits for its group mates).
  pool    the same EnvGroupRunner, but a group starts the moment group_size env instances are free,
          each freed by its own episode's end (ROLL's env workers; not what the scheduler does);
          by default only at --headline-mu-ms (--pool all: at every μ).

Part 2, redundant env rollout: async (product admission) with redundancy 0 vs --redundancy (2), the
same --groups groups of --redundancy-turns (4) turns, latency normal(--redundancy-mu-ms (300), σ = μ)
with a slow tail: an env instance is --slow-factor (10) times slower with probability --slow-fraction
(0.1), drawn from its latency seed (a slow machine, not a slow call). Redundancy starts group_size + k
episodes per group; the first group_size to finish form the group, the rest are cancelled and their
requests aborted. Shorter episodes here keep generation well below env time (see docs/benchmarks.md).

The last line is a JSON object: per μ the wall seconds, episodes/s and engine idle fraction (the
proxy's idle_fraction over the mode's window) of each mode (the median of --repeats interleaved
runs; all seconds in seconds_runs), `speedup` = batch s / async s (paper: 2.46× at μ = σ) and
`speedup_pool` = batch s / pool s; the top-level ones are those at --headline-mu-ms (300);
`speedup_redundancy` = seconds with redundancy 0 / seconds with --redundancy.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_flash.agentic import Env, SyncEnv  # noqa: E402
from megatron_flash.ports import free_ports  # noqa: E402
from megatron_flash.agentic.env_manager import EnvGroupRunner, SeedPrompt  # noqa: E402
from megatron_flash.agentic.protocol import StepResult  # noqa: E402
from megatron_flash.config.schema import AgenticConfig  # noqa: E402

MAX_SEQ_LEN = 256  # the tiny model's max_position_embeddings


class FixedTurnsEnv(SyncEnv):
    """Exactly `turns` steps whatever the action: observation 'k<step>', reward 1 on the last step."""

    def __init__(self, *, turns: int = 8) -> None:
        if turns < 1:
            raise ValueError(f"turns must be >= 1, got {turns}")
        self.turns, self.k = turns, 0

    def reset(self, seed: int) -> str:
        self.k = 0
        return "k0"

    def step(self, action_text: str) -> StepResult:
        self.k += 1
        done = self.k >= self.turns
        return StepResult(observation=f"k{self.k % 10}", reward=float(done), done=done)


ENV_NAME = f"{__name__}:FixedTurnsEnv"  # "module:Class", imported by the product's registry


def normal_ms(mu_ms: float) -> dict[str, Any]:
    return {"dist": "normal", "mean_s": mu_ms / 1000.0, "std_s": mu_ms / 1000.0}


def is_slow(latency_seed: int, slow_fraction: float) -> bool:
    return random.Random(latency_seed).random() < slow_fraction


class EnvPool:
    """A fixed number of env instances (ROLL's env workers): a group needs group_size + redundancy
    free ones to start, and each episode gives its instance back when its env closes."""

    def __init__(self, size: int) -> None:
        self.free = size
        self._changed = asyncio.Condition()

    async def take(self, num: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.free >= num)
            self.free -= num

    async def give_back(self) -> None:
        async with self._changed:
            self.free += 1
            self._changed.notify_all()


class _PooledEnv(Env):
    def __init__(self, env: Env, pool: EnvPool) -> None:
        self.env, self.pool = env, pool

    async def reset(self, seed: int) -> str:
        return await self.env.reset(seed)

    async def step(self, action_text: str) -> StepResult:
        return await self.env.step(action_text)

    async def close(self) -> None:
        try:
            await self.env.close()
        finally:
            await self.pool.give_back()


class BenchRunner(EnvGroupRunner):
    """EnvGroupRunner with two benchmark hooks on its env factory (the episodes run unchanged):

    slow tail  an env instance is slow_factor× slower with probability slow_fraction, drawn from the
               seed the product gives its LatencyEnv, so an instance is slow or not in every run
               (redundancy only adds instances with their own draws);
    pool       when set, each env hands its instance back to the EnvPool when it closes."""

    slow_fraction: float = 0.0
    slow_factor: float = 1.0
    pool: Optional[EnvPool] = None

    def _make_env(self, seed: int) -> Any:
        if self.slow_fraction and is_slow(seed, self.slow_fraction):
            from megatron_flash.agentic.registry import make_env
            from megatron_flash.agentic.wrappers import LatencyEnv

            spec = {**self.cfg.latency["step_latency"]}
            spec["mean_s"], spec["std_s"] = spec["mean_s"] * self.slow_factor, spec["std_s"] * self.slow_factor
            env = LatencyEnv(make_env(self.cfg.env, **dict(self.cfg.env_params)), step_latency=spec, seed=seed)
        else:
            env = super()._make_env(seed)  # the product's: make_env + LatencyEnv seeded per episode
        return _PooledEnv(env, self.pool) if self.pool is not None else env


def make_runner(proxy: Any, tokenizer: Any, args: argparse.Namespace, *, latency: dict[str, Any],
                redundancy: int = 0, slow_fraction: float = 0.0) -> BenchRunner:
    cfg = AgenticConfig(env=ENV_NAME, env_params={"turns": args.turns}, max_turns=args.turns,
                        max_tokens_per_turn=args.tokens_per_turn, max_episode_tokens=MAX_SEQ_LEN,
                        redundancy=redundancy, latency={"step_latency": latency})
    cfg.validate()
    runner = BenchRunner(agentic_cfg=cfg, proxy=proxy, tokenizer=tokenizer,
                         sampling_params={"temperature": 1.0, "ignore_eos": True},
                         max_seq_len=MAX_SEQ_LEN, version_fn=lambda: 0)
    runner.slow_fraction, runner.slow_factor = slow_fraction, args.slow_factor
    return runner


def prompt(group: int, args: argparse.Namespace) -> SeedPrompt:
    return SeedPrompt(index=group, seed=args.seed + group)


# ------------------------------------------------------------------ the modes
async def run_async(runner: BenchRunner, args: argparse.Namespace, *, admission: str = "group") -> dict[str, Any]:
    """The product's EnvGroupRunner on --groups groups, --concurrent-groups × group size env instances.

    admission "group": as the product's scheduler, a new group starts the moment one lands (at most
    --concurrent-groups run_group calls); "pool": a new group starts the moment enough env instances
    are free, each freed by its own episode's end (ROLL's env workers: no instance waits for its
    group mates)."""
    samples: list[Any] = []

    async def one(g: int) -> None:
        samples.extend(await runner.run_group(group_id=g, prompt=prompt(g, args), version=0,
                                              group_size=args.group_size))

    per_group = args.group_size + runner.cfg.redundancy
    if admission == "group":
        groups = iter(range(args.groups))

        async def slot() -> None:
            for g in groups:  # shared iterator: each group is run once, by whichever slot is free
                await one(g)

        await asyncio.gather(*[slot() for _ in range(args.concurrent_groups)])
    else:
        runner.pool = EnvPool(args.concurrent_groups * per_group)
        tasks = []
        for g in range(args.groups):
            await runner.pool.take(per_group)
            tasks.append(asyncio.create_task(one(g)))
        await asyncio.gather(*tasks)
    return {"episodes": len(samples), "turns": runner.stats.take().turns,
            "model_tokens": sum(sum(s.response_mask) for s in samples)}


@dataclasses.dataclass
class _Episode:
    env: Any
    prompt_ids: list[int]
    messages: list[dict[str, str]]
    budget: int
    ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    turns: int = 0
    done: bool = False


async def run_batch(runner: EnvGroupRunner, args: argparse.Namespace) -> dict[str, Any]:
    """Baseline: the episodes of --concurrent-groups groups act in lockstep, turn by turn.

    Same envs (the runner's own factory and seeds), same token bookkeeping (the runner's ChatTokens),
    same per-turn token limits as EnvGroupRunner._turns."""
    chat, proxy, cfg = runner.chat, runner.proxy, runner.cfg
    finished: list[_Episode] = []
    for first in range(0, args.groups, args.concurrent_groups):
        keys = [(g, i) for g in range(first, min(first + args.concurrent_groups, args.groups))
                for i in range(args.group_size)]
        # The runner's own env factory and latency seeds (EnvGroupRunner._episode: seed * 1009 + index).
        envs = [runner._make_env(prompt(g, args).seed * 1009 + i) for g, i in keys]
        observations = await asyncio.gather(*[env.reset(prompt(g, args).seed) for env, (g, _) in zip(envs, keys)])
        episodes = []
        for env, obs in zip(envs, observations):
            prompt_ids, messages = chat.first(obs)
            episodes.append(_Episode(env, prompt_ids, messages,
                                     min(cfg.max_episode_tokens, runner.max_seq_len - len(prompt_ids) - 1)))
        for turn in range(cfg.max_turns):
            live = [e for e in episodes if not e.done]
            if not live:
                break
            for e in live:
                e.done = e.budget - len(e.ids) <= 0  # as the product: no room left, the episode ends
            live = [e for e in live if not e.done]
            rooms = [min(cfg.max_tokens_per_turn, e.budget - len(e.ids)) for e in live]
            results = await asyncio.gather(*[
                proxy.generate(e.prompt_ids + e.ids, {**runner.sampling_params, "max_new_tokens": room})
                for e, room in zip(live, rooms)])  # all actions of the turn; wait for the last
            actions = []
            for e, res in zip(live, results):
                e.ids += list(res.output_ids)
                e.mask += [1] * len(res.output_ids)
                e.turns += 1
                actions.append(runner.decode(res.output_ids))
            steps = await asyncio.gather(*[e.env.step(a) for e, a in zip(live, actions)])  # wait for the slowest
            for e, action, step in zip(live, actions, steps):
                if step.done:
                    e.done = True
                    continue
                tail = [] if e.ids[-1:] == [chat.eos_id] else [chat.eos_id]
                obs_ids, e.messages = chat.observation(e.messages, action, step.observation)
                if len(e.ids) + len(tail) + len(obs_ids) >= e.budget:
                    e.done = True  # as the product: the observation would not fit
                    continue
                e.ids += tail + obs_ids
                e.mask += [0] * (len(tail) + len(obs_ids))
        await asyncio.gather(*[env.close() for env in envs])
        finished += episodes
    return {"episodes": len(finished), "turns": sum(e.turns for e in finished),
            "model_tokens": sum(sum(e.mask) for e in finished)}


MODES = {"batch": run_batch, "async": run_async,
         "pool": lambda runner, args: run_async(runner, args, admission="pool")}


async def timed(url: str, tokenizer: Any, args: argparse.Namespace, mode: str, *, mu_ms: float,
                redundancy: int = 0, slow_fraction: float = 0.0) -> dict[str, Any]:
    """One mode on a fresh proxy; engine idle fraction over exactly the mode's window."""
    from megatron_flash.rollout.proxy import LLMProxy

    # Enough slots that the proxy never queues: every env instance may have a request in flight.
    max_inflight = args.concurrent_groups * (args.group_size + redundancy)
    async with LLMProxy.from_urls([url], max_inflight_per_engine=max_inflight) as proxy:
        runner = make_runner(proxy, tokenizer, args, latency=normal_ms(mu_ms), redundancy=redundancy,
                             slow_fraction=slow_fraction)
        proxy.reset_metrics()
        t0 = time.perf_counter()
        out = await MODES[mode](runner, args)
        seconds = time.perf_counter() - t0
        engine = proxy.metrics().engines[0]
    return {**out, "seconds": round(seconds, 2), "episodes_per_s": round(out["episodes"] / seconds, 2),
            "idle_fraction": round(engine.idle_fraction, 3)}


def slow_counts(args: argparse.Namespace) -> dict[str, int]:
    """Part 2's slow instances (latency seeds as the product's: env seed * 1009 + episode index)."""
    per_group = [[is_slow(prompt(g, args).seed * 1009 + i, args.slow_fraction)
                  for i in range(args.group_size + args.redundancy)] for g in range(args.groups)]
    return {
        "slow_instances": sum(sum(slow[:args.group_size]) for slow in per_group),  # what redundancy 0 runs
        "groups_with_slow": sum(any(slow[:args.group_size]) for slow in per_group),
        # more than k slow of group_size + k: redundancy cannot help, the group waits for a slow one
        "groups_unrescued": sum(sum(slow) > args.redundancy for slow in per_group),
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median seconds (the lower middle one for an even count), with all seconds."""
    ordered = sorted(runs, key=lambda r: r["seconds"])
    return {**ordered[(len(ordered) - 1) // 2], "seconds_runs": [r["seconds"] for r in runs]}


def log(msg: str) -> None:
    print(f"[env_async {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mu-ms", default="100,300",
                   help="env step latency μ = σ values in ms, comma-separated; empty skips part 1")
    p.add_argument("--headline-mu-ms", type=float, default=300.0,
                   help="the μ whose speedups are the top-level ones (default: the last of --mu-ms if absent)")
    p.add_argument("--groups", type=int, default=64, help="groups per mode (the same in every mode)")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--concurrent-groups", type=int, default=16,
                   help="groups in flight (async) = groups per lockstep step (batch)")
    p.add_argument("--turns", type=int, default=8, help="steps per episode (FixedTurnsEnv)")
    p.add_argument("--tokens-per-turn", type=int, default=4, help="model tokens per turn (ignore_eos)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each mode per μ, interleaved; the median run is reported")
    p.add_argument("--pool", choices=("none", "headline", "all"), default="headline",
                   help="at which μ to also run the pool admission variant of async")
    p.add_argument("--redundancy", type=int, default=2, help="extra episodes per group in part 2; 0 skips part 2")
    p.add_argument("--redundancy-mu-ms", type=float, default=300.0)
    p.add_argument("--redundancy-turns", type=int, default=4,
                   help="steps per episode in part 2 (shorter than --turns: keeps generation well below env time)")
    p.add_argument("--slow-fraction", type=float, default=0.1)
    p.add_argument("--slow-factor", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0, help="first env seed (group g uses seed + g)")
    p.add_argument("--model-path", default="", help="HF model dir (default: make the tiny model in a temp dir)")
    p.add_argument("--num-blocks", type=int, default=1024, help="local engine server KV blocks of 16 tokens (its context length: num_blocks x 16)")
    p.add_argument("--max-running", type=int, default=64, help="local engine server slots (requests decoded together)")
    args = p.parse_args(argv)
    args.mus = [float(m) for m in args.mu_ms.split(",") if m.strip()]
    for name in ("groups", "group_size", "concurrent_groups", "turns", "tokens_per_turn", "redundancy_turns",
                 "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    turns = max(args.turns, args.redundancy_turns)
    if 18 + turns * (args.tokens_per_turn + 19) > MAX_SEQ_LEN:  # prompt + per turn: action, eos, observation
        p.error(f"--turns {turns} × --tokens-per-turn {args.tokens_per_turn} do not fit in the tiny "
                f"model's {MAX_SEQ_LEN} positions")
    return args


def main() -> int:
    args = parse_args()
    import transformers

    from megatron_flash.engines.launcher import EngineLauncher

    by_mu: dict[str, Any] = {}
    redundancy: dict[str, Any] = {}
    headline_mu = args.headline_mu_ms if args.headline_mu_ms in args.mus else (args.mus or [None])[-1]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model_path or os.path.join(tmp, "model")
        if not args.model_path:
            subprocess.run([sys.executable, os.path.join(REPO, "tools/make_tiny_model.py"), "--out", model],
                           check=True, capture_output=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(model)
        launcher = EngineLauncher(backend="local", model_path=model, num_engines=1, base_port=free_ports(1),
                                  run_dir=os.path.join(tmp, "run"), startup_timeout_s=180,
                                  server_args={"num-blocks": args.num_blocks,
                                               "max-running-requests": args.max_running})
        with launcher:
            url = launcher.urls[0]
            run = lambda mode, **kw: asyncio.run(timed(url, tokenizer, args, mode, **kw))  # noqa: E731
            asyncio.run(timed(url, tokenizer, argparse.Namespace(**{**vars(args), "groups": 2}), "async", mu_ms=1.0))
            work = ("episodes", "turns", "model_tokens")
            for mu in args.mus:
                pool = args.pool == "all" or (args.pool == "headline" and mu == headline_mu)
                modes = ("batch", "async") + (("pool",) if pool else ())
                runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
                for r in range(args.repeats):  # interleaved, the order rotated: load drifts hit every mode
                    for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                        runs[mode].append(run(mode, mu_ms=mu))
                row = {mode: median_run(runs[mode]) for mode in modes}
                for one in sum(runs.values(), []):  # identical work in every mode
                    assert {k: one[k] for k in work} == {k: row["batch"][k] for k in work}, runs
                row["speedup"] = round(row["batch"]["seconds"] / row["async"]["seconds"], 3)
                if "pool" in row:
                    row["speedup_pool"] = round(row["batch"]["seconds"] / row["pool"]["seconds"], 3)
                by_mu[f"{mu:g}"] = row
                log(f"mu=sigma={mu:g} ms: " + ", ".join(f"{m} {row[m]['seconds']} s (idle {row[m]['idle_fraction']})"
                                                       for m in MODES if m in row)
                    + f"; speedup {row['speedup']}" + (f", pool {row['speedup_pool']}" if "pool" in row else ""))
            tail_args = argparse.Namespace(**{**vars(args), "turns": args.redundancy_turns})
            ks = sorted({0, args.redundancy}) if args.redundancy else []
            tail_runs: dict[int, list[dict[str, Any]]] = {k: [] for k in ks}
            for r in range(args.repeats if ks else 0):
                for k in ks[r % 2:] + ks[:r % 2]:
                    tail_runs[k].append(asyncio.run(timed(
                        url, tokenizer, tail_args, "async", redundancy=k, mu_ms=args.redundancy_mu_ms,
                        slow_fraction=args.slow_fraction)))
            for k in ks:
                redundancy[f"r{k}"] = median_run(tail_runs[k])
                log(f"redundancy {k}: {redundancy[f'r{k}']}")
    headline = by_mu[f"{headline_mu:g}"] if by_mu else {"speedup": None}
    result = {
        "speedup": headline["speedup"], "speedup_pool": headline.get("speedup_pool"),
        "speedup_redundancy": (round(redundancy["r0"]["seconds"] / redundancy[f"r{args.redundancy}"]["seconds"], 3)
                               if redundancy else None),
        "headline_mu_ms": headline_mu,
        "groups": args.groups, "group_size": args.group_size, "concurrent_groups": args.concurrent_groups,
        "env_instances": args.concurrent_groups * args.group_size, "turns": args.turns,
        "tokens_per_turn": args.tokens_per_turn, "by_mu": by_mu,
        "redundancy": {"k": args.redundancy, "mu_ms": args.redundancy_mu_ms, "turns": args.redundancy_turns,
                       "slow_fraction": args.slow_fraction,
                       "slow_factor": args.slow_factor, **redundancy,
                       **slow_counts(args)},
    }
    print(json.dumps(result))
    return 0



if __name__ == "__main__":
    sys.exit(main())
