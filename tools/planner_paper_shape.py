"""The planner's paper-shape sweep (model only), for `tools/validate_planner.py --paper-shape`: speedup of
the best train/rollout split over synchronous colocated training vs GPU count and vs length spread."""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_flash import planner  # noqa: E402


def paper_shape(*, steps: int, seeds: int, gpus: list[int], sigmas: list[float], batch: int, max_len: int,
                len_mean: float, alpha: int, sigma_gpus: int, admission: str) -> dict:
    """Model only: 7B (28 layers, 4 KV heads), H100 table, lognormal lengths, α = `alpha`, `admission` (the
    tables of 2026-11-24 in docs/benchmarks.md predate adaptive admission: eager). For each total GPU
    count the best train/rollout split (train GPUs in steps of G/8) vs synchronous colocated training on all
    G GPUs; then at `sigma_gpus` GPUs the same vs the length spread σ."""
    model = planner.ModelSpec(num_params=7e9, num_layers=28, hidden_size=3584, num_kv_heads=4, head_dim=128)
    gpu = planner.GPUSpec.from_name("H100")

    def best(total: int, sigma: float) -> dict:
        work = planner.Workload(batch_size=batch, group_size=8, prompt_len=512,
                                lengths=planner.lognormal_lengths(len_mean, sigma, max_len))
        mean = planner._mean_len(work)
        costs = planner.Costs.from_models(model=model, gpu=gpu, engine_tp=1, mean_ctx=512 + mean / 2,
                                          max_ctx=512 + max_len, prompt_len=512)
        run = lambda **kw: statistics.fmean(planner.simulate(work=work, costs=costs, num_steps=steps, seed=s,  # noqa: E731
                                                             admission=admission,
                                                             **kw).sec_per_step for s in range(seeds))
        base = run(num_engines=total, train_gpus=total, alpha=0, colocated=True)
        unit = max(1, total // 8)
        rows = [(base / run(num_engines=total - t, train_gpus=t, alpha=alpha), t) for t in range(unit, total, unit)]
        sp, t = max(rows)
        return {"speedup": round(sp, 3), "train_gpus": t, "rollout_gpus": total - t, "sync_s_per_step": round(base, 2),
                "mean_len": round(mean, 1)}

    out: dict = {"vs_gpus": {}, "vs_sigma": {}}
    for g in gpus:
        out["vs_gpus"][g] = best(g, 1.0)
        print(f"  {g:>3} GPUs, σ = 1.0: {out['vs_gpus'][g]}", flush=True)
    for sg in sigmas:
        out["vs_sigma"][sg] = best(sigma_gpus, sg)
        print(f"  {sigma_gpus} GPUs, σ = {sg}: {out['vs_sigma'][sg]}", flush=True)
    return out
