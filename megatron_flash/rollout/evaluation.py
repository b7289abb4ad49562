"""Evaluation on held-out sets: n responses per prompt, scored with the run's reward function.

    sets = load_eval_sets(cfg.eval, tokenizer, seed=cfg.trainer.seed)
    metrics, records = await evaluate(proxy, sets, reward_pool, decode, settings)

Per set `name` (a response is correct when its reward >= eval.correct_threshold):

    eval/<name>/mean@n            mean reward over every response
    eval/<name>/pass@k            k = 1, 2, 4, …, n: the unbiased estimator 1 − C(n−c, k) / C(n, k)
                                  per prompt (c correct of n), averaged over prompts
    eval/<name>/response_len_mean, num_prompts, aborted (responses an engine cut short, scored as
                                  they are), off_version (responses whose engine reported another
                                  weight version than the one evaluated: must be 0)

The caller pins the version: in a run the controller evaluates between two weight pushes (the
trainer thread, which alone pushes, waits for the evaluation), so no request can be aborted by a
push or span two versions; `off_version` checks it on every reply.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import math
import os
import time
from typing import Any, Callable, Optional, Sequence

from megatron_flash.config.schema import DataConfig
from megatron_flash.rollout.dataset import Prompt, PromptDataset
from megatron_flash.trace import TRACER, TRAINER, tag_requests

logger = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 1_000_003
"""Synthetic evaluation tasks are drawn with trainer.seed + this (held out from training's draw)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021): 1 − C(n−c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def ks_for(n: int) -> list[int]:
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


@dataclasses.dataclass
class EvalSet:
    name: str
    prompts: list[Prompt]


@dataclasses.dataclass
class EvalSettings:
    n_samples: int
    max_new_tokens: int
    temperature: float
    correct_threshold: float
    version: Optional[str]
    """The weight version label the engines serve (replies are checked against it); None before the
    first push, when engines carry their own start label ("default"): then every reply must carry the
    same label as the others."""


def load_eval_sets(eval_cfg: Any, tokenizer: Any, *, seed: int) -> list[EvalSet]:
    sets = []
    for name, spec in eval_cfg.datasets.items():
        data = DataConfig(**{**spec, "shuffle": False})
        try:
            ds = PromptDataset.from_config(data, tokenizer, seed=seed + EVAL_SEED_OFFSET)
        except (ValueError, FileNotFoundError) as error:
            raise ValueError(f"eval.datasets.{name}: {error}") from error
        sets.append(EvalSet(name, ds.prompts))
    return sets


def _summary(name: str, rows: list[list[dict]], n: int, threshold: float) -> dict[str, float]:
    rewards = [r["reward"] for per_prompt in rows for r in per_prompt]
    out = {f"eval/{name}/mean@{n}": sum(rewards) / len(rewards),
           f"eval/{name}/num_prompts": float(len(rows)),
           f"eval/{name}/response_len_mean": sum(r["length"] for p in rows for r in p) / len(rewards),
           f"eval/{name}/aborted": float(sum(r["finish_reason"] == "abort" for p in rows for r in p)),
           f"eval/{name}/off_version": float(sum(not r["on_version"] for p in rows for r in p))}
    for k in ks_for(n):
        out[f"eval/{name}/pass@{k}"] = sum(pass_at_k(n, sum(r["reward"] >= threshold for r in p), k)
                                           for p in rows) / len(rows)
    return out


async def evaluate(proxy: Any, sets: Sequence[EvalSet], reward_pool: Any, decode: Callable[[list[int]], str],
                   settings: EvalSettings) -> tuple[dict[str, float], list[dict]]:
    """(metrics, one record per response). Every response is its own request (spread over engines)."""
    params = {"temperature": settings.temperature, "max_new_tokens": settings.max_new_tokens}

    async def one(prompt: Prompt, set_name: str, i: int) -> dict:
        tag_requests(eval=set_name, prompt=prompt.index)
        result = await proxy.generate(list(prompt.prompt_ids), params, rid=f"eval-{set_name}-{prompt.index}-{i}")
        ids = list(result.output_ids)
        outcome = await reward_pool.score(decode(ids), prompt.answer, finished=result.finish_reason == "stop",
                                          prompt=prompt.text, meta=prompt.meta)
        return {"set": set_name, "prompt_index": prompt.index, "sample": i, "reward": float(outcome.reward),
                "length": len(ids), "finish_reason": result.finish_reason,
                "weight_version": str(result.weight_version)}

    metrics: dict[str, float] = {}
    records: list[dict] = []
    for s in sets:
        t0 = time.monotonic()
        rows = await asyncio.gather(*(asyncio.gather(*(one(p, s.name, i) for i in range(settings.n_samples)))
                                      for p in s.prompts))
        rows = [list(r) for r in rows]
        labels = collections.Counter(r["weight_version"] for p in rows for r in p)
        expected = settings.version if settings.version is not None else labels.most_common(1)[0][0]
        for r in (r for p in rows for r in p):
            r["on_version"] = r["weight_version"] == expected
        metrics.update(_summary(s.name, rows, settings.n_samples, settings.correct_threshold))
        metrics[f"eval/{s.name}/seconds"] = time.monotonic() - t0
        records.extend(r for per_prompt in rows for r in per_prompt)
    return metrics, records


class PeriodicEvaluation:
    """A run's evaluation schedule (eval.every_steps, plus the first and the last step): `maybe`
    evaluates through the rollout runtime, appends a row to {run_dir}/eval.jsonl and every response
    to eval_samples.jsonl, and logs the metrics to the tracker's TensorBoard / W&B."""

    def __init__(self, eval_cfg: Any, sets: list[EvalSet], *, run_dir: str, max_new_tokens: int, runtime: Any,
                 tracker: Any) -> None:
        self.cfg, self.sets, self.run_dir = eval_cfg, sets, run_dir
        self.max_new_tokens = eval_cfg.max_new_tokens or max_new_tokens
        self.runtime, self.tracker = runtime, tracker
        self._done_at: Optional[int] = None

    def maybe(self, steps_done: int, *, version: int, first: bool, final: bool) -> None:
        every = self.cfg.every_steps
        if self._done_at == steps_done or not (first or final or (every and steps_done % every == 0)):
            return
        settings = EvalSettings(n_samples=self.cfg.n_samples, max_new_tokens=self.max_new_tokens,
                                temperature=self.cfg.temperature, correct_threshold=self.cfg.correct_threshold,
                                version=str(version) if version > 0 else None)
        t0 = time.monotonic()
        with TRACER.span("evaluate", "eval", TRAINER, version=version, sets=len(self.sets)):
            metrics, records = self.runtime.evaluate(self.sets, settings)
        self._done_at = steps_done
        with open(os.path.join(self.run_dir, "eval.jsonl"), "a") as f:
            f.write(json.dumps({"step": steps_done, "version": version, "seconds": time.monotonic() - t0,
                                **metrics}) + "\n")
        with open(os.path.join(self.run_dir, "eval_samples.jsonl"), "a") as f:
            for r in records:
                f.write(json.dumps({"step": steps_done, "version": version, **r}) + "\n")
        self.tracker.log_side(steps_done, metrics)
        logger.info("evaluation at version %d: %s", version, ", ".join(
            f"{k.removeprefix('eval/')}={v:.3f}" for k, v in metrics.items() if "mean@" in k or "pass@1" in k))
