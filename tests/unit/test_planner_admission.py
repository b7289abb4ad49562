"""The planner's admission (planner/admission.py: the product's Lookahead of buffer/staleness.py on the
simulation's clock) driven beside the product's StalenessManager over the same events, and the
simulation's lookahead, trainer wait and token staleness worked out by hand."""

import inspect
import itertools
import random

import pytest

from megatron_flash import planner
from megatron_flash.buffer import staleness as product
from megatron_flash.planner import admission as mirror
from megatron_flash.planner.engine import Engine


def test_the_planner_runs_the_products_rule():
    """One definition: the simulation's admission is buffer/staleness.py's Lookahead on its own clock, the
    rule names are the config's, and the helpers are the product's functions themselves."""
    from megatron_flash.config.schema import ADMISSIONS

    assert issubclass(mirror.Admission, product.Lookahead)
    assert mirror.ADMISSIONS is product.ADMISSIONS is ADMISSIONS
    from megatron_flash.planner import simulation

    assert simulation.late_share is product.late_share and mirror.capacity is product.capacity
    for alpha in range(5):
        assert mirror.Admission(admission="adaptive", alpha=alpha, batch_size=4).lookahead == product.lookahead_floor(alpha)


def test_the_planners_default_admission_is_the_products():
    from megatron_flash.config.schema import AsyncConfig
    assert planner.DEFAULT_ADMISSION == AsyncConfig().admission
    assert inspect.signature(planner.simulate).parameters["admission"].default == planner.DEFAULT_ADMISSION


def test_token_rule_by_hand():
    """The table of admission.py, tokens: no wait steps down by 1/8 to the floor; a wait below one batch
    adds the late share up to 1; at or above one batch only when the engines starved, up to α."""
    f = product.next_token_lookahead
    assert f(1.0, alpha=2, waits_in_a_row=0, late=0.0, starved=False, floor=0.0) == 0.875
    assert f(1.0, alpha=2, waits_in_a_row=0, late=0.0, starved=False, floor=1.0) == 1.0
    assert f(0.5, alpha=2, waits_in_a_row=1, late=0.25, starved=False, floor=0.0) == 0.75
    assert f(0.875, alpha=2, waits_in_a_row=1, late=0.5, starved=False, floor=0.0) == 1.0
    assert f(1.0, alpha=2, waits_in_a_row=1, late=0.3, starved=False) == 1.0
    assert f(1.0, alpha=2, waits_in_a_row=2, late=0.3, starved=True) == pytest.approx(1.3)
    assert f(1.9, alpha=2, waits_in_a_row=2, late=0.3, starved=True) == 2.0
    assert f(1.0, alpha=2, waits_in_a_row=1, late=0.3, starved=True) == 1.0  # one wait past a batch: a blip
    # tokens 10 landed at 2.5 and 8 at 3.4; the trainer began waiting at 3.0: 8 of 18 came late
    assert product.late_share(tokens=[10, 8], arrived=[2.5, 3.4], since=3.0) == pytest.approx(8 / 18)
    a = mirror.Admission(admission="tokens", alpha=2, batch_size=4, min_lookahead=0.0)
    a.lookahead = 0.875
    assert a.limit(1) == 8 + 3  # ⌊0.875 · 4⌋ of the next batch


@pytest.mark.parametrize("min_lookahead", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("alpha", [1, 2, 4])
def test_the_token_lookahead_moves_as_the_products_over_the_same_events(alpha, min_lookahead):
    """Random admits, landings and takes (wait, late share) into both, on the same clock; L and the limit
    agree after each take. Stretches with the engines left idle alternate with busy ones."""
    batch = 8
    rng = random.Random(alpha * 7 + int(min_lookahead * 4))
    mgr = product.StalenessManager(alpha=alpha, batch_size=batch, extra=10**6, admission="tokens",
                                   min_lookahead=min_lookahead)
    base = mgr._rule.idle_since  # the product's idle clock starts when it is made; ours is told the same start
    ours = mirror.Admission(admission="tokens", alpha=alpha, batch_size=batch, min_lookahead=min_lookahead,
                            start=base)
    now, in_flight, seen = base, 0, set()
    for i in range(400):
        now += rng.choice((0.05, 0.2, 0.5))
        idle_phase = (i // 40) % 2 == 1
        event = rng.choice(("land", "land", "take") if idle_phase else ("admit", "admit", "land", "take"))
        if event == "admit":
            assert mgr.try_admit(2, now=now) == 0
            ours.on_admit(now=now)
            in_flight += 1
        elif event == "land" and in_flight:
            in_flight -= 1
            mgr.on_landed(0, 2, now=now)
            ours.on_landed(now=now, in_flight=in_flight)
        elif event == "take":
            waited_s = rng.choice((0.0, 0.01, 0.3))
            late = rng.choice((0.0, 0.25, 0.6))
            mgr.note_take(waited_s=waited_s, surplus=0, now=now, late=late)
            ours.note_take(waited_s=waited_s, surplus=0, now=now, late=late)
            assert ours.lookahead == pytest.approx(mgr.lookahead)
            assert ours.limit(3) == product.capacity(version=3, alpha=mgr.lookahead, batch_size=batch, extra=0,
                                                     consumed=0, outstanding=0)
            seen.add(round(mgr.lookahead, 3))
    if alpha > min_lookahead:  # else L is pinned at α
        assert len(seen) >= 4  # the lookahead moved both ways


@pytest.mark.parametrize("admission", ["adaptive", "eager"])
@pytest.mark.parametrize("alpha", [0, 1, 2, 4])
def test_the_lookahead_moves_as_the_products_over_the_same_takes(admission, alpha):
    """Random takes (wait, period, finished samples left buffered) into both; L agrees after each. The
    waits straddle the tolerance and the surplus straddles one batch, so every branch is taken; stretches
    of rollout-bound takes (no surplus) alternate with mixed ones so that L climbs all the way."""
    batch = 8
    rng = random.Random(alpha * 10 + len(admission))
    mgr = product.StalenessManager(alpha=alpha, batch_size=batch, admission=admission)
    ours = mirror.Admission(admission=admission, alpha=alpha, batch_size=batch)
    now, seen = 0.0, set()
    for i in range(300):
        rollout_bound = (i // 30) % 2 == 0
        period = rng.choice((0.5, 1.0, 2.0))
        waited_s = period * rng.choice((0.02, 0.2, 0.9) if rollout_bound else (0.0, 0.02, 0.2, 0.9))
        surplus = rng.choice((0, batch - 1) if rollout_bound else (0, batch - 1, batch, 3 * batch))
        now += period
        mgr.note_take(waited_s=waited_s, surplus=surplus, now=now)
        ours.note_take(waited_s=waited_s, surplus=surplus, now=now)
        assert ours.lookahead == mgr.lookahead
        assert ours.limit(7) == product.capacity(version=7, alpha=mgr.lookahead, batch_size=batch, extra=0,
                                                 consumed=0, outstanding=0)
        seen.add(mgr.lookahead)
    if admission == "adaptive" and alpha >= 2:
        assert seen == set(range(1, alpha + 1))  # it went up to α and back down to 1


def test_the_worked_example_of_the_admission_docstring():
    # α = 2, B = 1: takes at 1.0, 1.2, 2.2, 3.4 s after waits 1.0, 0.0, 0.8, 1.0 s. The first starts the clock;
    # 1.2 did not wait; 2.2 waited 0.8 of 1.0 s (one in a row); 3.4 waited 1.0 of 1.2 s (two) → L = 2. Then a
    # take with a whole batch left buffered lowers it again.
    a = mirror.Admission(admission="adaptive", alpha=2, batch_size=1)
    got = []
    for now, w, surplus in ((1.0, 1.0, 0), (1.2, 0.0, 0), (2.2, 0.8, 0), (3.4, 1.0, 0), (3.5, 0.0, 1)):
        a.note_take(waited_s=w, surplus=surplus, now=now)
        got.append(a.lookahead)
    assert got == [1, 1, 1, 2, 1]
    with pytest.raises(ValueError, match="admission="):
        mirror.Admission(admission="greedy", alpha=2, batch_size=1)
    with pytest.raises(ValueError, match="min_lookahead="):
        mirror.Admission(admission="tokens", alpha=2, batch_size=1, min_lookahead=3.0)


def test_token_versions_split_at_the_pushes():
    # Pushes at virtual positions 4 and 16; a sequence decoding (10, 20]: 6 tokens of version 1, 4 of version 2.
    e = Engine(lambda k: 1.0)
    e.pushes = [4.0, 16.0]
    assert e.version_sum(10.0, 20.0) == pytest.approx(6 * 1 + 4 * 2)
    assert e.version_sum(0.0, 4.0) == pytest.approx(0.0)       # all before the first push
    assert e.version_sum(16.0, 18.0) == pytest.approx(2 * 2)   # begins at the push: all new


def _lengths(seq):
    seen: dict[int, int] = {}

    def draw(rng):  # the k-th draw of each generator (the planner's 4000-draw mean uses its own)
        k = seen.get(id(rng), 0)
        seen[id(rng)] = k + 1
        return seq[k] if k < len(seq) else 10
    return draw


def _run(admission, num_steps=4):
    w = planner.Workload(batch_size=1, group_size=1, lengths=_lengths([10, 10, 10, 15, 10]))
    c = planner.Costs(decode_step=lambda k: 0.1, engine_cap=64, prefill_s=0.0, train_s=lambda g, t: 0.3, sync_s=0.0)
    return planner.simulate(work=w, costs=c, num_engines=1, train_gpus=1, alpha=2, num_steps=num_steps,
                            admission=admission)


def test_adaptive_admission_waits_twice_then_looks_further_ahead_with_token_staleness_by_hand():
    """One engine, 0.1 s a decode step whatever runs, training 0.3 s, α = 2, one sample a step, lengths
    10, 10, 10, 15, 10 tokens. Adaptive starts at L = 1: s0, s1 start at 0 (v 0) and end at 1.0.
      take s0 at 1.0 (waited 1.0: the first take only starts the clock)            L 1
      push 1.3 (V 1, engine at S 10); take s1 (v 0), no wait; s2 starts (v 1, S 10 → 20)
      push 1.6 (V 2, S 13); nothing buffered; s3 starts (v 2, S 13 → 28)
      s2 ends 2.3: take at V 2, waited 0.7 of 1.0 s (one in a row)                  L 1
           tokens: 3 decoded at version 1, 7 at version 2 → token staleness 3/10 = 0.3
      push 2.6 (V 3, S 23); s4 starts (v 3)
      s3 ends 3.1: take at V 3, waited 0.5 of 0.8 s (two in a row)                  L 2
           tokens: 10 at version 2, 5 at version 3 → 10/15; sample staleness 3 − 2 = 1"""
    r = _run("adaptive")
    got = [(x.t, x.version, x.wait_s, x.lookahead, x.staleness, x.token_staleness) for x in r.takes]
    want = [(1.0, 0, 1.0, 1, 0, 0.0), (1.3, 1, 0.0, 1, 1, 1.0), (2.3, 2, 0.7, 1, 1, 0.3),
            (3.1, 3, 0.5, 2, 1, 10 / 15)]
    assert len(got) == len(want)
    for g, x in zip(got, want):
        assert g == pytest.approx(x), (g, x)
    # every take: staleness per sample (0 + 1 + 1 + 1) / 4; per token (0 + 10 + 3 + 10) / 45
    assert r.staleness_mean == pytest.approx(0.75)
    assert r.token_staleness_mean == pytest.approx(23 / 45)
    # the steady state leaves out the pipeline fill, α + 1 = 3 steps: of 4, the last take alone
    assert r.train_wait_s == pytest.approx(0.5) and r.lookahead_mean == pytest.approx(2.0)


def test_eager_admission_starts_alpha_batches_ahead_and_trains_them_older():
    # Eager (L = α = 2): s0, s1, s2 start at 0 and end at 1.0 (all of version 0); trained at V = 0, 1, 2
    # (takes at 1.0, 1.3, 1.6): staleness 0, 1, 2, per sample and per token alike.
    r = _run("eager", num_steps=3)
    assert [x.t for x in r.takes[:3]] == pytest.approx([1.0, 1.3, 1.6])
    assert [x.staleness for x in r.takes[:3]] == [0, 1, 2]
    assert [x.token_staleness for x in r.takes[:3]] == pytest.approx([0.0, 1.0, 2.0])
    assert all(x.lookahead == 2 for x in r.takes)


def test_token_admission_in_the_simulation_by_hand():
    """buffer/staleness.py's worked example for tokens, run by the simulation: B = 4 in groups of 2, α = 2,
    min_lookahead 0, one engine at 0.1 s a decode step whatever runs, training 1 s; lengths 10 (the first
    8 samples), 5, 5, then 4.
      0.0  L = 1: limit 4 + 4 = 8 samples → 4 groups start (v 0), all land at 1.0
      1.0  take batch 0 (the first take starts the clock); the engines idle from 1.0
      2.0  push → V 1; take batch 1 at once (no wait) → L 0.875; limit 8 + 3 = 11 → 1 group (v 1), lands 2.5
      3.0  push → V 2; limit 12 + 3 = 15 → 2 groups (v 2), land at 3.4
      3.4  take batch 2 (the v 1 group, one v 2 group) after 0.4 s of a 1.4 s period; 8 of its 18 tokens
           landed during the wait → L = min(0.875 + 8/18, 1) = 1. Staleness: per sample (1 + 0) / 2,
           per token 10 · 1 / 18 (the v 1 group decoded 2.0-2.5 under version 1, the v 2 group under 2)."""
    w = planner.Workload(batch_size=4, group_size=2, lengths=_lengths([10] * 8 + [5, 5, 4, 4, 4, 4]))
    c = planner.Costs(decode_step=lambda k: 0.1, engine_cap=64, prefill_s=0.0, train_s=lambda g, t: 1.0, sync_s=0.0)
    r = planner.simulate(work=w, costs=c, num_engines=1, train_gpus=1, alpha=2, num_steps=3, admission="tokens",
                         min_lookahead=0.0)
    got = [(x.t, x.version, x.wait_s, x.lookahead, x.staleness, x.token_staleness) for x in r.takes[:3]]
    want = [(1.0, 0, 1.0, 1.0, 0.0, 0.0), (2.0, 1, 0.0, 0.875, 1.0, 1.0), (3.4, 2, 0.4, 1.0, 0.5, 10 / 18)]
    for g, x in zip(got, want, strict=True):
        assert g == pytest.approx(x), (g, x)
