"""Queue scheduling + redundant prompts (the product's rollout) vs batch generation, with a dynamic filter.

    OMP_NUM_THREADS=1 python benchmarks/queue_scheduling.py [--steps 10] [--rounds 2] [--engines 2] [--extra-prompts 4]

Every mode fills the same steps: --prompts groups of --n responses per step that pass the filter
(nonzero_std: a group whose rewards are all equal carries no signal and is dropped), on --engines
Local engine servers with the same flags, from the same model and prompt distribution:

  batch            written here with EngineClient: a step's missing groups are submitted together
                   (each response its own request, spread evenly over the engines) and the step
                   waits for the slowest; groups the filter drops are regenerated with fresh prompts
                   in another round, until the step has --prompts groups (the synchronous
                   "generate, filter, generate again" loop).
  queue            the product: `launch/pretrain_async_rl.py trainer.mode=rollout_only` with
                   rollout.dynamic_filter=nonzero_std and rollout.extra_prompts=--extra-prompts. Each
                   response is its own request, dispatched the moment an engine slot frees; a dropped
                   group frees admission capacity at once, so the next prompt starts while the rest of
                   the step runs; --extra-prompts groups beyond the batch are admitted too.
  queue_no_extra   the same with rollout.extra_prompts=0 (skipped with --no-reference).

Engines: each runs at most --max-running requests at once (its KV cache holds that many worst cases;
the product's engines.max_inflight_per_engine is the same); the batch mode queues the rest inside
the engine. Default 4: a decode step of the local engine costs about the same for 1 to 4 sequences
(measured 3.2 ms / 4.0 ms; 7.2 ms for 16, 18 ms for 64), as a GPU's does up to large batches, so a
slot left empty at a round's tail wastes about what it wastes on a GPU. With many more running
requests the local engine's cost is per sequence and tails cost little (see docs/benchmarks.md);
--decode-step-ms T (e.g. 20, above the CPU step at --max-running) makes every engine step last T ms for
1 to --max-running sequences, as a GPU's does (latency injection; engines/local_server.py).
Workload: the long-tail model of benchmarks/benchlib.py (response lengths P(k) ∝ 1/k, 1 ≤ k ≤ --max-len,
per response); rewards from a synthetic verifier with a per-prompt pass rate drawn from --pass-rates
(a data column that reaches the reward as `meta`): prompts that always or never pass give all-equal
groups, ≈ 45% of groups with the default rates. α = --alpha (default 0: as in the batch loop, every
group trains the step it was generated for).

The last line is a JSON object: seconds per step (steady state, the first --skip steps left out),
kept samples/s, tokens generated per step, engine idle fraction and engine CPU per token per mode,
rounds per step (batch), groups dropped per step (queue), `speedup` = batch s/step / queue s/step
(paper: 3.4×) and `speedup_no_extra`. Modes are interleaved over --rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402


class IdleClock:
    """Per engine: seconds with nothing of ours in flight (the proxy's idle_fraction, for the baseline)."""

    def __init__(self, num: int) -> None:
        self.inflight, self.idle, self.t0 = [0] * num, [0.0] * num, time.monotonic()
        self._since = [self.t0] * num

    def start(self, i: int) -> None:
        if self.inflight[i] == 0:
            self.idle[i] += time.monotonic() - self._since[i]
        self.inflight[i] += 1

    def end(self, i: int) -> None:
        self.inflight[i] -= 1
        if self.inflight[i] == 0:
            self._since[i] = time.monotonic()

    def window(self) -> float:
        """Mean idle fraction since the last call; starts a new window."""
        now = time.monotonic()
        fracs = []
        for i in range(len(self.idle)):
            idle = self.idle[i] + (now - self._since[i] if self.inflight[i] == 0 else 0.0)
            fracs.append(idle / max(now - self.t0, 1e-9))
            self.idle[i], self._since[i] = 0.0, now
        self.t0 = now
        return statistics.fmean(fracs)


async def batch_generation(urls: list[str], *, data: str, model: str, steps: int, prompts: int, n: int,
                           max_new_tokens: int, seed: int) -> tuple[list[dict], Any]:
    """The baseline: per step, rounds of "submit every missing group's responses, wait for all, filter"
    until `prompts` groups are kept. Returns per-step rows and the CPU monitor of this process."""
    import transformers

    from megatron_flash.engines.client import EngineClient
    from megatron_flash.rollout.filters import get_filter

    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    with open(data) as f:
        rows = [json.loads(line) for line in f]
    random.Random(seed).shuffle(rows)
    ids = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    keep = get_filter("nonzero_std")
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": max_new_tokens}
    clients = [EngineClient(u) for u in urls]
    clock = IdleClock(len(clients))
    cursor, tokens = 0, [0]

    async def one(k: int, prompt_ids: list[int], row: dict) -> float:
        clock.start(k)
        try:
            r = await clients[k].generate(prompt_ids, params)
        finally:
            clock.end(k)
        tokens[0] += len(r.output_ids)
        text = tokenizer.decode(r.output_ids, skip_special_tokens=True)
        return benchlib.graded_reward(text, row["answer"], finished=r.finish_reason == "stop", meta=row)

    out = []
    monitor = benchlib.CpuMonitor(os.getpid()) if os.path.isdir("/proc") else None
    try:
        clock.window()
        for step in range(steps):
            t0, kept, rounds, generated, tokens[0] = time.monotonic(), 0, 0, 0, 0
            while kept < prompts:
                need = prompts - kept
                picks = [(cursor + g) % len(rows) for g in range(need)]
                cursor += need
                # One round: every response of every missing group at once, spread evenly over engines.
                rewards = await asyncio.gather(*[one((g * n + i) % len(clients), ids[j], rows[j])
                                                 for g, j in enumerate(picks) for i in range(n)])
                kept += sum(keep(rewards[g * n:(g + 1) * n]) for g in range(need))
                rounds += 1
                generated += need
            out.append({"time_step": time.monotonic() - t0, "rounds": rounds, "groups_generated": generated,
                        "tokens": tokens[0], "engine_idle_frac": clock.window()})
            if monitor is not None:
                monitor.snapshot(step)
    finally:
        for c in clients:
            await c.close()
    return out, monitor


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="runs per mode, interleaved")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--max-running", type=int, default=4,
                   help="requests an engine runs at once (its KV cache holds this many worst cases; the "
                        "product's engines.max_inflight_per_engine is set to it too)")
    p.add_argument("--prompts", type=int, default=16, help="kept groups per step")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--extra-prompts", type=int, default=4, help="redundant groups in flight (queue mode)")
    p.add_argument("--no-reference", action="store_true", help="skip the queue run without redundant prompts")
    p.add_argument("--alpha", type=int, default=0)
    p.add_argument("--pass-rates", default="0,0.25,0.5,0.75,1")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--max-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-path", default="")
    p.add_argument("--out", default="runs/bench_queue_scheduling")
    benchlib.add_engine_device_args(p)
    args = p.parse_args()
    name = "queue_scheduling"
    model = args.model_path or benchlib.long_tail_model(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                                        max_len=args.max_len, name=name)
    out = os.path.join(benchlib.REPO, args.out)
    os.makedirs(out, exist_ok=True)
    data = os.path.join(out, "prompts.jsonl")
    benchlib.write_graded_data(data, rows=4096, pass_rates=[float(x) for x in args.pass_rates.split(",")],
                               seed=args.seed)
    max_new = args.max_len + 8
    # The local engine admits a request once its worst case (prompt of 2 + max_new tokens) fits: size it so
    # that --max-running requests run at once.
    server_args = {**benchlib.engine_capacity_server_args(args, max_running=args.max_running,
                                                          request_tokens=2 + max_new),
                   **benchlib.engine_device_server_args(args)}
    batch = args.prompts * args.n
    product = [f"data.path={data}", "data.task=", "trainer.mode=rollout_only", f"trainer.total_steps={args.steps}",
               f"trainer.global_batch_size={batch}", f"trainer.micro_batch_size={batch}",
               f"rollout.n_samples_per_prompt={args.n}", f"rollout.max_new_tokens={max_new}",
               f"trainer.max_seq_len={max_new + 8}", "rollout.dynamic_filter=nonzero_std",
               "rollout.reward=benchlib:graded_reward", f"async_rl.alpha={args.alpha}", f"trainer.seed={args.seed}",
               f"engines.max_inflight_per_engine={args.max_running}",
               *[f"engines.server_args.{k}={v}" for k, v in server_args.items()]]
    modes = {"batch": None, "queue": args.extra_prompts}  # mode → rollout.extra_prompts of the product
    if args.extra_prompts > 0 and not args.no_reference:
        modes["queue_no_extra"] = 0
    results: dict[str, list[dict]] = {m: [] for m in modes}
    t0, load_before = time.time(), benchlib.uptime_load()
    for r in range(args.rounds):
        for mode in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
            if mode != "batch":
                rows, mon = benchlib.run_pipeline(
                    model=model, run_dir=os.path.join(out, f"{mode}_r{r}"), name=name, num_engines=args.engines,
                    monitor=True, overrides=[*product, f"rollout.extra_prompts={modes[mode]}"])
                for row in rows:
                    row["tokens"] = row["tokens_per_s"] * row["time_step"]  # generated, filtered ones included
                s = benchlib.steady(rows, skip=args.skip, keys=("time_step", "engine_idle_frac", "tokens"))
                first, last, counted = rows[args.skip - 1] if args.skip else {}, rows[-1], len(rows) - args.skip
                for key in ("dropped_filtered", "dropped_stale"):
                    s[f"groups_{key}_per_step"] = (last[key] - first.get(key, 0)) / args.n / counted
            else:
                from megatron_flash.engines.launcher import EngineLauncher

                launcher = EngineLauncher(backend="local", model_path=model, num_engines=args.engines,
                                          base_port=benchlib.free_ports(args.engines),
                                          run_dir=os.path.join(out, f"batch_r{r}"), startup_timeout_s=300,
                                          server_args=server_args, env={"OMP_NUM_THREADS": "1"})
                with launcher:
                    steps, mon = asyncio.run(batch_generation(
                        launcher.urls, data=data, model=model, steps=args.steps, prompts=args.prompts, n=args.n,
                        max_new_tokens=max_new, seed=args.seed + r))
                s = benchlib.steady(steps, skip=args.skip, keys=("time_step", "engine_idle_frac", "tokens", "rounds",
                                                                "groups_generated"))
            s.update(mon.cores(skip=args.skip) if mon is not None else {})
            if "cores_engines" in s:  # engine CPU per generated token: how hard the engines worked, load aside
                s["engine_cpu_ms_per_token"] = 1e3 * s["cores_engines"] * s["time_step"] / max(s["tokens"], 1)
            results[mode].append(s)
            benchlib.log(name, f"{mode} round {r}: {s['time_step']:.3f} s/step, engine idle "
                               f"{s['engine_idle_frac']:.2f}")

    result: dict = {"engines": args.engines, "max_running": args.max_running, "kept_groups_per_step": args.prompts,
                    "n": args.n, "extra_prompts": args.extra_prompts, "alpha": args.alpha, "steps": args.steps,
                    "skip": args.skip, "rounds": args.rounds, "model": os.path.relpath(model, benchlib.REPO),
                    "pass_rates": args.pass_rates, "decode_step_ms": args.decode_step_ms}
    cores = ("cores_trainer", "cores_engines", "cores_others")
    for mode in modes:
        keys = (("rounds", "groups_generated") if mode == "batch" else
                ("groups_dropped_filtered_per_step", "groups_dropped_stale_per_step"))
        result[mode] = {k: benchlib.round_mean(results[mode], k) for k in ("time_step", "engine_idle_frac", "tokens", *keys, *cores,
                                                   "engine_cpu_ms_per_token")}
        result[mode]["kept_samples_per_s"] = round(batch / result[mode]["time_step"], 2)
        result[mode]["sec_per_step_per_round"] = [round(x["time_step"], 3) for x in results[mode]]
    if "queue_no_extra" in modes:
        no_extra = benchlib.speedup_fields(results["batch"], results["queue_no_extra"])
        result["speedup_no_extra"], result["speedup_no_extra_median"] = no_extra["speedup"], no_extra["speedup_median"]
    result.update(benchlib.speedup_fields(results["batch"], results["queue"]))
    result["load_avg_1m_before"] = load_before
    result["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
