"""Evaluate a checkpoint on the held-out sets of a run config, on its own (no trainer).

    python launch/evaluate.py --config configs/quickstart_cpu.yaml model.hf_path=runs/quickstart/final_hf \\
        'eval.datasets={sort4: {task: sort4, num_samples: 64}}' eval.n_samples=8

The engines of the config's `engines` section serve `model.hf_path` (launched, or attached with
engines.backend=attach); every set of `eval.datasets` gets eval.n_samples responses per prompt,
scored with `rollout.reward`, exactly as the run's own evaluation (megatron_flash/rollout/evaluation.py):
mean@n and the unbiased pass@k. Writes `{logging.dir}/eval.jsonl` (one row) and
`eval_samples.jsonl`; prints the row as JSON on the last stdout line.

Exit codes: 0 done, 2 bad command line or config, 1 the evaluation failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_flash.config import ConfigError, load_config  # noqa: E402


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", default=[], help="run config YAML (may repeat)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config or None, args.overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not cfg.eval.datasets:
        print("error: eval.datasets is empty: name at least one held-out set", file=sys.stderr)
        return 2
    if not cfg.model.hf_path or not os.path.isfile(os.path.join(cfg.model.hf_path, "config.json")):
        print(f"error: model.hf_path={cfg.model.hf_path!r} is not a Hugging Face model directory", file=sys.stderr)
        return 2

    import transformers

    from megatron_flash.engines.launcher import EngineLauncher
    from megatron_flash.rewards import RewardPool
    from megatron_flash.rollout.evaluation import EvalSettings, evaluate, load_eval_sets
    from megatron_flash.rollout.proxy import LLMProxy

    run_dir = cfg.logging.dir
    os.makedirs(run_dir, exist_ok=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(cfg.model.hf_path)
    sets = load_eval_sets(cfg.eval, tokenizer, seed=cfg.trainer.seed)
    e = cfg.eval

    async def run(urls: list[str], version: str) -> tuple[dict, list]:
        settings = EvalSettings(n_samples=e.n_samples, max_new_tokens=e.max_new_tokens or cfg.rollout.max_new_tokens,
                                temperature=e.temperature, correct_threshold=e.correct_threshold, version=version)
        pool = RewardPool(cfg.rollout.reward, num_workers=cfg.rollout.reward_workers)
        try:
            async with LLMProxy.from_config(cfg.engines, urls) as proxy:
                return await evaluate(proxy, sets, pool,
                                      lambda ids: tokenizer.decode(ids, skip_special_tokens=True), settings)
        finally:
            pool.close()

    async def version_of(url: str) -> str:
        from megatron_flash.engines.client import EngineClient

        async with EngineClient(url, api_key=cfg.engines.api_key) as client:
            return await client.get_weight_version()

    t0 = time.monotonic()
    launcher = EngineLauncher.from_config(cfg.engines, model_path=cfg.model.hf_path, run_dir=run_dir)
    try:
        with launcher:
            version = asyncio.run(version_of(launcher.urls[0]))  # the label of the checkpoint as loaded
            metrics, records = asyncio.run(run(launcher.urls, version))
    except Exception as error:
        print(f"error: evaluation failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    row = {"model": cfg.model.hf_path, "version": version, "seconds": round(time.monotonic() - t0, 2), **metrics}
    with open(os.path.join(run_dir, "eval.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    with open(os.path.join(run_dir, "eval_samples.jsonl"), "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
