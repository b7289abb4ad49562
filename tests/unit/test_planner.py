"""Capacity planner (megatron_flash/planner/): invariants with expectations computed by hand."""

import copy
import importlib.util
import itertools
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


def test_measured_decode_interpolates_between_and_extrapolates_beyond_the_points():
    step = planner.measured_decode([(16, 4.0), (1, 1.0), (4, 2.5)])
    assert step(1) == pytest.approx(1.0) and step(4) == pytest.approx(2.5) and step(16) == pytest.approx(4.0)
    assert step(2) == pytest.approx(1.5)          # 1 + (2.5 - 1) / 3
    assert step(10) == pytest.approx(3.25)        # 2.5 + 1.5 * 6 / 12
    assert step(32) == pytest.approx(6.0)         # the last segment's slope 1.5 / 12 per sequence, 16 more
    with pytest.raises(ValueError, match="two or more"):
        planner.measured_decode([(4, 1.0)])


def test_per_request_cost_is_engine_time_of_every_request():
    # 64 requests start together on one engine at 0.01 s per step: 100 tokens = 1 s, plus 0.5 s each
    # of per-request cost shared by all (processor sharing): every request ends at 1.5 s.
    c = _costs(cap=64, train=0.0)
    c.per_request_s = 0.5
    r = planner.simulate(work=_work(), costs=c, num_engines=1, train_gpus=1, alpha=0, num_steps=6)
    assert r.sec_per_step == pytest.approx(1.5)


def test_dynamic_filter_regenerates_dropped_groups():
    # One group per step, generated one at a time (α = 0) in 1 s; half are dropped: a step needs
    # 1 / 0.5 = 2 groups on average (geometric), so 2 s per step; batch mode the same here.
    w = planner.Workload(batch_size=8, group_size=8, lengths=lambda rng: 100, keep_prob=0.5)
    c = _costs(cap=8, train=0.0)
    for scheduling in ("queue", "batch"):
        r = planner.simulate(work=w, costs=c, num_engines=1, train_gpus=1, alpha=0, num_steps=600,
                             scheduling=scheduling)
        assert r.sec_per_step == pytest.approx(2.0, rel=0.1), scheduling
        assert r.groups_dropped == pytest.approx(600, rel=0.15)


def test_redundant_groups_are_cancelled_when_too_stale_to_train():
    # α = 0, one group per step plus one redundant: both finish together (constant lengths), the trainer
    # takes one, the other is expired at the push: one cancelled group per step, 1 s per step.
    w = planner.Workload(batch_size=8, group_size=8, lengths=lambda rng: 100)
    r = planner.simulate(work=w, costs=_costs(cap=64, train=0.0), num_engines=1, train_gpus=1, alpha=0,
                         num_steps=10, extra_groups=1)
    assert r.sec_per_step == pytest.approx(1.0) and r.groups_cancelled == 10 and r.staleness_mean == 0.0


def test_group_cap_limits_concurrency_and_chunks_match_their_limits():
    # 8 groups per step, at most 2 generating, each 1 s (constant lengths): 4 s per step in steady state.
    w = planner.Workload(batch_size=64, group_size=8, lengths=lambda rng: 100, max_inflight_groups=2)
    r = planner.simulate(work=w, costs=_costs(cap=64, train=0.0), num_engines=1, train_gpus=1, alpha=8,
                         num_steps=12)
    assert r.sec_per_step == pytest.approx(4.0)
    tail = _work(lengths=planner.inv_k_lengths(64))
    kw = dict(work=tail, costs=_costs(cap=16), num_engines=4, train_gpus=1, alpha=1, num_steps=10)
    assert planner.simulate(replication_chunk=8, **kw).sec_per_step == pytest.approx(
        planner.simulate(prompt_replication=False, **kw).sec_per_step)


def test_members_of_an_n_sampling_request_leave_the_batch_as_they_end():
    # One request of 2 sampled sequences (no replication), lengths 2 and 10 drawn in turn; a decode step
    # costs 1 s with 1 sequence running and 1.5 s with 2. By hand: 2 steps with both (3 s), then the long
    # one alone for 8 (8 s): 11 s a step at α = 0 without training. Charging both until the longest ends
    # (the engine decoding a finished member) would give 10 × 1.5 = 15 s.
    draws = itertools.cycle([2, 10])  # the planner's 4000-draw mean takes an even number: order kept
    w = planner.Workload(batch_size=2, group_size=2, lengths=lambda rng: next(draws))
    c = planner.Costs(decode_step=lambda k: 1.0 if k <= 1 else 1.5, engine_cap=3, prefill_s=0.0,
                      train_s=lambda g, t: 0.0, sync_s=0.0)
    kw = dict(costs=c, num_engines=1, train_gpus=1, alpha=0, num_steps=4, prompt_replication=False)
    assert planner.simulate(work=w, **kw).sec_per_step == pytest.approx(11.0)
    # Two such requests (A, B) on an engine capped at 3 sequences: B needs 2 free slots and A holds its 2
    # until its last member ends (the proxy's accounting), though only 1 of them decodes after 3 s. So B
    # starts at 11 s and ends at 22 s: 22 s a step. Releasing A's finished member's slot would let B in at
    # 3 s (17 s a step).
    w.batch_size = 4
    assert planner.simulate(work=w, **kw).sec_per_step == pytest.approx(22.0)


def test_rollout_client_hands_out_requests_one_at_a_time():
    # 8 requests, 0.1 s of client each: they start at 0.1, 0.2, ... 0.8 s; a decode step costs 0.01 s
    # whatever the batch, so each takes 1 s: the last ends at 1.8 s; α = 0 repeats that every step.
    c = _costs(cap=64, train=0.0)
    c.client_per_request_s = 0.1
    w = planner.Workload(batch_size=8, group_size=8, lengths=lambda rng: 100)
    r = planner.simulate(work=w, costs=c, num_engines=1, train_gpus=1, alpha=0, num_steps=6)
    assert r.sec_per_step == pytest.approx(1.8)


def test_measured_decode_costs_drive_the_simulation_as_computed_by_hand():
    # Points (4, 2 ms) and (16, 6 ms): 8 sequences interpolate to 2 + 4 · 4/12 = 3.333 ms a step, 32 extrapolate
    # along the last segment to 6 + (4/12) · 16 = 11.333 ms. Constant length 10, α = 0, no training: a step is
    # one round of 10 decode steps with every sample running.
    step = planner.measured_decode([(4, 0.002), (16, 0.006)])
    for batch, per_step in ((8, 0.02 / 6), (32, 0.034 / 3)):
        w = planner.Workload(batch_size=batch, group_size=8, lengths=lambda rng: 10)
        c = planner.Costs(decode_step=step, engine_cap=64, prefill_s=0.0, train_s=lambda g, t: 0.0, sync_s=0.0)
        r = planner.simulate(work=w, costs=c, num_engines=1, train_gpus=1, alpha=0, num_steps=5)
        assert r.sec_per_step == pytest.approx(10 * per_step), batch
    # 8 samples on an engine capped at 4: two rounds of 10 steps at 4 sequences (2 ms): 40 ms a step.
    c.engine_cap = 4
    w = planner.Workload(batch_size=8, group_size=8, lengths=lambda rng: 10)
    assert planner.simulate(work=w, costs=c, num_engines=1, train_gpus=1, alpha=0,
                            num_steps=5).sec_per_step == pytest.approx(0.040)


def test_engine_exclusive_request_cost_adds_up_over_concurrent_requests():
    # 8 requests start together on one engine, 100 tokens at 10 ms a step = 1 s of decoding. Engine-exclusive
    # 50 ms each: the engine first spends 8 × 50 ms = 0.4 s on them, so all end at 1.4 s; the same 50 ms as
    # per_request_s (processor-shared) costs 50 ms once: 1.05 s.
    w = planner.Workload(batch_size=8, group_size=8, lengths=lambda rng: 100)
    c = _costs(cap=64, train=0.0)
    c.request_engine_s = 0.05
    assert planner.simulate(work=w, costs=c, num_engines=1, train_gpus=1, alpha=0,
                            num_steps=6).sec_per_step == pytest.approx(1.4)
    c.request_engine_s, c.per_request_s = 0.0, 0.05
    assert planner.simulate(work=w, costs=c, num_engines=1, train_gpus=1, alpha=0,
                            num_steps=6).sec_per_step == pytest.approx(1.05)


def test_without_redundancy_the_trainer_waits_for_a_straggler_that_is_due():
    # One sample per step (group of 1), α = 1, decode 10 ms a step whatever the batch, training 0.5 s. The first
    # sample drawn is 300 tokens (3 s), every other 10 (0.1 s). By hand: s0 and s1 start at 0; s1 trains
    # 0.1-0.6 (V = 1); s2 starts at 0.6, ends 0.7, but s0 (v = 0) is due at V = 1: the trainer waits for it
    # (3.0), trains it first (3.0-3.5), then s2, s3, ... back to back: steps end at 0.6, 3.5, 4.0, ..., so
    # 10 steps end at 7.5 s. Nothing is cancelled; staleness 0 for s1, 1 for every later sample (the 11th
    # batch starts at 7.5 s as the run stops: 10 of 11 taken samples at staleness 1).
    seen: dict[int, int] = {}

    def lengths(rng):
        n = seen.get(id(rng), 0)
        seen[id(rng)] = n + 1
        return 300 if n == 0 else 10

    w = planner.Workload(batch_size=1, group_size=1, lengths=lengths)
    r = planner.simulate(work=w, costs=_costs(cap=64, train=0.5), num_engines=1, train_gpus=1, alpha=1, num_steps=10)
    assert r.total_s == pytest.approx(7.5)
    assert r.groups_cancelled == 0 and r.staleness_mean == pytest.approx(10 / 11)


@pytest.mark.parametrize("prefix_cache,expected", [(False, 11.1), (True, 8.0)])
def test_multi_turn_prefill_charges_the_uncached_context_each_turn(prefix_cache, expected):
    """One sample of 3 turns, 2 tokens each, 1 s per decode step, no env wait, prompt 10 tokens, 5 tokens
    appended per env turn, 0.1 s per prefilled token. Without a prefix cache each turn prefills the whole
    conversation: 10, then 10+2+5 = 17, then 17+2+5 = 24 tokens → 1.0 + 1.7 + 2.4 s of prefill + 3 × 2 s of
    decode = 11.1 s. With it: 10, 5, 5 tokens → 1.0 + 0.5 + 0.5 + 6 = 8.0 s. Training takes 0 s."""
    w = planner.Workload(batch_size=1, group_size=1, prompt_len=10, lengths=lambda rng: 2, num_turns=3,
                         turn_tokens=5)
    c = _costs(step=1.0, train=0.0, cap=4)
    c.prefill_token_engine_s, c.prefix_cache = 0.1, prefix_cache
    r = planner.simulate(work=w, costs=c, num_engines=1, train_gpus=1, alpha=0, num_steps=1)
    assert r.total_s == pytest.approx(expected)


def test_validation_predicts_the_uncontended_async_step_from_the_sync_stage_times():
    """tools/validate_planner.py at a small size: the engine seconds per request solved from the 16-core
    box's α = 0 rollout stage (0.870 s) are a few ms (the closed-loop engine alone: 1.5), and with them
    the α = 2 step (measured 1.012 s) and the speedup (1.854×) come out within 5 %."""
    vp = _validate_planner()
    alone, fitted = vp.CostSet("alone"), vp.CostSet("stage time")
    p = vp.fit_request_cost(vp.MEASURED["avs16"], alone, seeds=1, steps=12)
    assert 0.002 < p < 0.006, p
    rows = {r["what"]: r for r in vp.async_vs_sync("avs16", [fitted], {"stage time": p}, seeds=1, steps=12)}
    assert abs(rows["sync (α=0) s/step"]["error"]["stage time"]) < 0.01  # the fit itself
    for what in ("async (α=2) s/step, α=0 stage times", "speedup"):
        assert abs(rows[what]["error"]["stage time"]) <= 0.05, rows[what]


def test_validation_with_same_hour_inputs_predicts_async_vs_sync_unfitted():
    """The 2026-11-24 async_vs_sync run (sync 1.120 s/step, α = 2 0.735 s, 1.525×) against the decode curve and
    closed-loop request cost measured minutes later, nothing fitted: the planner's sync step and speedup
    land within 5 %, and the request cost solved from the run's own α = 0 stage agrees with the closed
    loop's 1.22 ms to within 25 % (both figures independent of the planner: /proc and wall clocks)."""
    vp = _validate_planner()
    alone = vp.CostSet("alone", step_large=vp.STEP_2026_11_24_L4_H160, request_s=vp.ENGINE_PER_REQUEST_2026_11_24,
                       client_s=vp.CLIENT_CPU_PER_REQUEST_2026_11_24)
    rows = {r["what"]: r for r in vp.async_vs_sync("avs2_2026_11_24", [alone], {}, seeds=1, steps=12)}
    for what in ("sync (α=0) s/step", "async (α=2) s/step, α=2 run's train/sync times", "speedup"):
        assert abs(rows[what]["error"]["alone"]) <= 0.05, rows[what]
    p = vp.fit_request_cost(vp.MEASURED["avs2_2026_11_24"], alone, seeds=1, steps=12)
    assert abs(p - 0.00122) <= 0.25 * 0.00122, p


def test_validation_predicts_token_staleness_under_adaptive_and_eager_admission():
    """The 2026-11-27 async_vs_sync run logged token staleness 0.90 with adaptive admission (L = 1 held) and
    1.86 with eager, at the same 0.854 s/step. With the request cost solved from that run's α = 0 stage, the
    planner's token staleness lands within 15 % of both, its lookahead at 1, and its steps within 15 %."""
    vp = _validate_planner()
    nov24 = dict(step_large=vp.STEP_2026_11_24_L4_H160, request_s=vp.ENGINE_PER_REQUEST_2026_11_24,
                 client_s=vp.CLIENT_CPU_PER_REQUEST_2026_11_24)
    p = vp.fit_request_cost(vp.MEASURED["avs2_2026_11_27"], vp.CostSet("alone", **nov24), seeds=1, steps=16)
    rows = {r["what"]: r for r in vp.admission([vp.CostSet("stage time", **nov24)], {"stage time": p}, seeds=1,
                                               steps=16)}
    for what in ("adaptive token staleness", "eager token staleness", "adaptive (α=2) s/step", "eager (α=2) s/step"):
        assert abs(rows[what]["error"]["stage time"]) <= 0.15, rows[what]
    assert rows["adaptive lookahead L"]["predicted"]["stage time"] == pytest.approx(1.0)


def test_validation_reads_measured_outputs_from_run_directories(tmp_path, monkeypatch):
    vp = _validate_planner()
    monkeypatch.setattr(vp, "MEASURED", copy.deepcopy(vp.MEASURED))
    for sub, steps in (("off_r0", [9, 9, 9, 0.4, 0.5]), ("off_r1", [9, 9, 9, 0.3, 0.3])):  # skip 3 warm-up steps
        d = tmp_path / "bench_pr_s3_8" / sub
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "time_step": t}) + "\n"
                                                 for i, t in enumerate(steps)))
    used = vp.read_runs(str(tmp_path))
    assert used == ["bench_pr_s3_8/off_r* (2 runs)"]
    assert vp.MEASURED["rep8"]["off"] == pytest.approx(0.375) and vp.MEASURED["rep8"]["off_rounds"] == [0.45, 0.3]
    assert vp.MEASURED["rep8"]["on"] == 0.376  # no run directory: the recorded constant stays


def _validate_planner():
    spec = importlib.util.spec_from_file_location("validate_planner", ROOT / "tools/validate_planner.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_push_bytes_follow_the_delta_density_and_the_anchors():
    model = planner.ModelSpec(num_params=1e9)  # bf16: 2 GB whole
    assert model.push_bytes() == 2e9
    # 1 % changed: 2 B values + 4 B int32 positions per changed value = 6e7 B per delta push
    assert model.push_bytes(0.01, anchor_every=0) == pytest.approx(6e7)
    # 10 %: the bitmask (1/8 B per value) is cheaper than positions (0.4 B): 2e8 + 1.25e8
    assert model.push_bytes(0.1, anchor_every=0) == pytest.approx(3.25e8)
    # one whole push in every 20: (2e9 + 19 · 6e7) / 20
    assert model.push_bytes(0.01, anchor_every=20) == pytest.approx((2e9 + 19 * 6e7) / 20)
    assert model.push_bytes(1.0, anchor_every=0) == 2e9  # never more than whole
    gpu = planner.GPUSpec.from_name("H100")
    costs = [planner.Costs.from_models(model=model, gpu=gpu, engine_tp=1, mean_ctx=100, max_ctx=200,
                                       sync_overhead_s=0.0, delta_density=d) for d in (0.0, 0.01)]
    assert costs[0].sync_s == pytest.approx(2e9 / 50e9) and costs[1].sync_s == pytest.approx((2e9 + 19 * 6e7) / 20 / 50e9)
    with pytest.raises(ValueError, match="delta density must be in"):
        model.push_bytes(1.5)
