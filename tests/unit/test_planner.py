"""Capacity planner (megatron_flash/planner.py): invariants with expectations computed by hand."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_flash import planner

ROOT = Path(__file__).resolve().parents[2]


def _costs(*, step=0.01, train=1.0, sync=0.0, cap=16):
    return planner.Costs(decode_step=lambda k: step, engine_cap=cap, prefill_s=0.0,
                         train_s=lambda g, tokens: train, sync_s=sync)


def _work(lengths=lambda rng: 100, batch=64, group=8):
    return planner.Workload(batch_size=batch, group_size=group, lengths=lengths)


def test_alpha_zero_on_a_split_equals_sync_with_the_same_stage_times():
    w, c = _work(lengths=planner.inv_k_lengths(128)), _costs()
    sync = planner.simulate(work=w, costs=c, num_engines=4, train_gpus=1, alpha=0, colocated=True, num_steps=20)
    a0 = planner.simulate(work=w, costs=c, num_engines=4, train_gpus=1, alpha=0, num_steps=20)
    assert a0.sec_per_step == pytest.approx(sync.sec_per_step, rel=1e-9)
    assert a0.staleness_mean == 0.0


def test_two_balanced_stages_constant_lengths_give_exactly_two():
    # 64 samples on 4 engines × 16 slots: generation = 100 tokens × 0.01 s = 1 s; train = 1 s
    w, c = _work(), _costs()
    sync = planner.simulate(work=w, costs=c, num_engines=4, train_gpus=1, alpha=0, colocated=True, num_steps=20)
    assert sync.sec_per_step == pytest.approx(2.0)
    for alpha in (1, 2, 4):
        r = planner.simulate(work=w, costs=c, num_engines=4, train_gpus=1, alpha=alpha, num_steps=20)
        assert r.sec_per_step == pytest.approx(1.0)
        assert sync.sec_per_step / r.sec_per_step <= 2.0 + 1e-9


def test_constant_lengths_queue_equals_batch():
    w, c = _work(), _costs()
    for alpha in (0, 2):
        q = planner.simulate(work=w, costs=c, num_engines=4, train_gpus=1, alpha=alpha, num_steps=15)
        b = planner.simulate(work=w, costs=c, num_engines=4, train_gpus=1, alpha=alpha, num_steps=15,
                             scheduling="batch")
        assert q.sec_per_step == pytest.approx(b.sec_per_step)


def test_long_tail_queue_beats_batch_and_speedup_is_monotone_in_alpha():
    w, c = _work(lengths=planner.inv_k_lengths(256), batch=128), _costs(train=0.5)
    kw = dict(work=w, costs=c, num_engines=4, train_gpus=1, num_steps=40)
    q = planner.simulate(alpha=2, **kw)
    b = planner.simulate(alpha=2, scheduling="batch", **kw)
    assert q.sec_per_step < b.sec_per_step
    secs = [planner.simulate(alpha=a, **kw).sec_per_step for a in (0, 1, 2, 4)]
    assert all(x >= y - 1e-9 for x, y in zip(secs, secs[1:])), secs


def test_stage_models_memory_bound_decode_grows_with_concurrency():
    model = planner.ModelSpec(num_params=7e9, num_layers=28, num_kv_heads=4)
    c = planner.Costs.from_models(model=model, gpu=planner.GPUSpec.from_name("H100"), engine_tp=1,
                                  mean_ctx=2000, max_ctx=8000)
    # one sequence: 14 GB of weights / (3350 GB/s × 0.8) ≈ 5.2 ms per token
    assert c.decode_step(1) == pytest.approx(14e9 / (3350e9 * 0.8), rel=0.01)
    assert 64 / c.decode_step(64) > 30 / c.decode_step(1)
    assert c.train_s(8, 10**6) == pytest.approx(6 * 7e9 * 1e6 / (8 * 989e12 * 0.4))
    with pytest.raises(ValueError, match="gpu="):
        planner.GPUSpec.from_name("B900")


def test_cli_last_line_is_json(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tools/plan_resources.py"), "--total-gpus", "16",
                          "--batch-size", "64", "--len-mean", "500", "--max-len", "2048", "--steps", "9",
                          "--png", str(tmp_path / "p.png")], capture_output=True, text=True, check=True, timeout=120)
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["recommended"]["train_gpus"] + last["recommended"]["rollout_gpus"] == 16
    assert (tmp_path / "p.png").stat().st_size > 0
