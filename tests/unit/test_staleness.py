"""Staleness arithmetic and the versioned buffer (pure; no engines, no Megatron)."""

from __future__ import annotations

import threading
import time

import pytest

from megatron_flash.buffer.sample_buffer import BufferClosed, SampleBuffer
from megatron_flash.buffer.staleness import (
    RAISE_AFTER,
    STEP_DOWN,
    WAIT_TOLERANCE,
    StalenessManager,
    capacity,
    is_trainable,
    late_share,
    lookahead_floor,
    next_lookahead,
    next_token_lookahead,
    waited,
)
from megatron_flash.types import Group, Sample


def group(gid: int, start: int, n: int = 2, t: float = 0.0) -> Group:
    samples = [Sample([1], [2], [-0.1], group_id=gid, version_start=start) for _ in range(n)]
    return Group(group_id=gid, prompt_index=gid, samples=samples, version_start=start, time_finished=t)


def test_worked_example_of_the_docstring() -> None:
    # B = 4, alpha = 1: the table in megatron_flash/buffer/staleness.py, recomputed by hand here.
    m = StalenessManager(alpha=1, batch_size=4)
    assert m.capacity() == 8
    for _ in range(4):
        assert m.try_admit(2) == 0
    assert m.try_admit(2) is None  # 8 outstanding: full
    m.on_consume(4)
    assert m.capacity() == 0
    m.set_version(1)
    assert m.capacity() == 4
    assert m.try_admit(2) == 1 and m.try_admit(2) == 1 and m.try_admit(2) is None
    m.on_consume(4)  # batch 1: the 4 started at v=0, 1 - 0 <= alpha
    m.set_version(2)
    assert m.capacity() == 4


@pytest.mark.parametrize("alpha", [0, 1, 2, 5])
def test_steady_state_bound_is_alpha_plus_one_batches(alpha: int) -> None:
    b = 8
    m = StalenessManager(alpha=alpha, batch_size=b)
    for version in range(20):
        m.set_version(version)
        while m.try_admit(1) is not None:
            pass
        assert m.counters.outstanding == (alpha + 1) * b  # in flight + buffered, never more
        m.on_consume(b)


def test_extra_prompts_over_admit_and_drops_free_capacity() -> None:
    m = StalenessManager(alpha=0, batch_size=4, extra=2)
    assert capacity(version=0, alpha=0, batch_size=4, extra=2, consumed=0, outstanding=0) == 6
    assert m.try_admit(6) == 0 and m.try_admit(1) is None
    m.on_drop(2, reason="filtered")
    assert m.capacity() == 2 and m.counters.dropped_filtered == 2


def test_is_trainable_table() -> None:
    # (version, start, alpha) -> trainable, from the definition V - v <= alpha (and v <= V)
    cases = {(0, 0, 0): True, (1, 0, 0): False, (3, 1, 2): True, (4, 1, 2): False, (2, 3, 2): False}
    for (v, s, a), expected in cases.items():
        assert is_trainable(v, s, a) is expected, (v, s, a)


def test_version_cannot_go_backwards() -> None:
    m = StalenessManager(alpha=1, batch_size=2)
    m.set_version(3)
    with pytest.raises(AssertionError):
        m.set_version(2)


def test_bad_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match="alpha >= 0"):
        StalenessManager(alpha=-1, batch_size=2)


def test_buffer_takes_oldest_whole_groups_and_evicts_stale() -> None:
    m = StalenessManager(alpha=1, batch_size=4)
    evicted: list[int] = []
    buf = SampleBuffer(m, stale_policy="regenerate", on_evict=lambda g: evicted.append(g.group_id))
    for gid, start in [(0, 0), (1, 2), (2, 1), (3, 2)]:
        buf.put(group(gid, start, t=gid))
    m.counters.outstanding = 8
    m.set_version(2)  # group 0 (start 0): 2 - 0 > 1, can never train again
    batch = buf.take_batch(4, timeout_s=1)
    assert [g.group_id for g in batch] == [2, 1]  # start 1 before start 2, then finish time
    assert evicted == [0] and m.counters.regenerated_stale == 2
    assert m.counters.consumed == 4 and m.counters.outstanding == 2
    assert buf.num_groups() == 1


def test_buffer_waits_for_a_full_batch_then_returns() -> None:
    m = StalenessManager(alpha=0, batch_size=4)
    m.counters.outstanding = 4
    buf = SampleBuffer(m)
    buf.put(group(0, 0))
    out: list = []
    t = threading.Thread(target=lambda: out.append(buf.take_batch(4, timeout_s=5, poll_s=0.01)))
    t.start()
    time.sleep(0.1)
    assert not out  # 2 of 4 samples: still waiting
    buf.put(group(1, 0))
    t.join(5)
    assert [g.group_id for g in out[0]] == [0, 1]


def test_buffer_timeout_and_close_are_errors_with_the_count() -> None:
    m = StalenessManager(alpha=0, batch_size=4)
    buf = SampleBuffer(m)
    buf.put(group(0, 0))
    with pytest.raises(TimeoutError, match="2 buffered"):
        buf.take_batch(4, timeout_s=0.05, poll_s=0.01)
    buf.close(RuntimeError("engines down"))
    with pytest.raises(BufferClosed) as info:
        buf.take_batch(4, timeout_s=1)
    assert "engines down" in str(info.value.__cause__)


def test_a_group_that_lands_without_put_wakes_the_waiting_trainer() -> None:
    """α = 1, B = 2 (groups of 2): at V = 1 the trainer waits for group 0 (start 0, in flight: it
    would expire after this step) although group 2 (start 1) is buffered. Group 0 is then filtered —
    it lands without a `put`. The trainer must re-check at once, not at its next poll (an hour here)."""
    m = StalenessManager(alpha=1, batch_size=2)
    buf = SampleBuffer(m)
    assert m.try_admit(2) == 0 and m.try_admit(2) == 0  # groups 0 and 1, both start 0
    m.on_landed(0, 2)
    buf.put(group(1, 0))
    assert [g.group_id for g in buf.take_batch(2, timeout_s=1)] == [1]  # V = 0: nothing expires yet
    m.set_version(1)
    assert m.try_admit(2) == 1
    m.on_landed(1, 2)
    buf.put(group(2, 1))
    out: list = []
    t = threading.Thread(target=lambda: out.append(buf.take_batch(2, poll_s=3600)), daemon=True)
    t.start()
    t.join(0.2)
    assert t.is_alive()  # waiting for group 0, which is still in flight
    m.on_drop(2, reason="filtered")
    buf.landed(0, 2)  # what the scheduler calls for every group that leaves flight
    t.join(30)
    assert not t.is_alive() and [g.group_id for g in out[0]] == [2]


def test_with_redundant_prompts_a_full_batch_goes_without_waiting_for_slower_groups() -> None:
    """α = 0, B = 2, extra = 2 samples: groups 0 and 1 admitted at V = 0; group 0 finishes first.
    Without redundancy the trainer would wait for every expiring in-flight sample; with it, the
    buffered full batch goes now (group 1 is surplus, cancelled by the scheduler after the push)."""
    m = StalenessManager(alpha=0, batch_size=2, extra=2)
    buf = SampleBuffer(m)
    assert m.try_admit(2) == 0 and m.try_admit(2) == 0 and m.try_admit(2) is None
    m.on_landed(0, 2)
    buf.put(group(0, 0))
    assert m.in_flight_through(0) == 2
    assert [g.group_id for g in buf.take_batch(2, timeout_s=5)] == [0]

    plain = StalenessManager(alpha=0, batch_size=4)
    buf2 = SampleBuffer(plain)
    assert plain.try_admit(2) == 0 and plain.try_admit(2) == 0
    plain.on_landed(0, 2)
    buf2.put(group(0, 0))
    buf2.put(group(5, 0))  # (a stray buffered group: still, group 1 is in flight and expiring)
    with pytest.raises(TimeoutError):
        buf2.take_batch(4, timeout_s=0.05, poll_s=0.01)


# ------------------------------------------------------------------ adaptive admission (lookahead)
@pytest.mark.parametrize("lookahead, alpha, waits, surplus, expected", [
    # (L, α, takes in a row that waited, finished samples left after the take with B = 4) → next L
    (1, 2, 2, 0, 2),   # the trainer waited two steps running: look further ahead
    (1, 2, 1, 0, 1),   # one wait is a blip: keep
    (2, 2, 3, 0, 2),   # ... never past α
    (2, 2, 0, 4, 1),   # a whole batch sat finished: come back
    (1, 2, 0, 8, 1),   # ... never below 1 (generation must overlap training)
    (2, 3, 0, 3, 2),   # less than a batch left: keep
    (1, 2, 2, 8, 2),   # persistent waits outrank a surplus (it may be the next version's, half done)
    (0, 0, 5, 0, 0),   # α = 0: synchronous, nothing to move
])
def test_next_lookahead_table(lookahead: int, alpha: int, waits: int, surplus: int, expected: int) -> None:
    assert next_lookahead(lookahead, alpha=alpha, waits_in_a_row=waits, surplus=surplus, batch_size=4) == expected
    assert RAISE_AFTER == 2 and lookahead_floor(0) == 0 and lookahead_floor(5) == 1


def test_a_wait_counts_past_the_tolerance_of_the_step() -> None:
    assert waited(0.5, 2.0) and not waited(0.9 * WAIT_TOLERANCE * 2.0, 2.0) and not waited(0.1, 0.0)


def test_adaptive_admission_worked_example_of_the_docstring() -> None:
    # B = 4, α = 2, every admitted sample finishes at once: the table in staleness.py, by hand.
    m = StalenessManager(alpha=2, batch_size=4, admission="adaptive")
    assert m.lookahead == 1 and m.capacity() == 8
    started = 0
    while m.try_admit(1) is not None:
        started += 1
    assert started == 8
    m.on_consume(4)
    m.note_take(waited_s=1.0, surplus=4, now=10.0)  # the first take only starts the clock
    assert m.lookahead == 1
    m.set_version(1)
    assert m.capacity() == 4
    for _ in range(4):
        assert m.try_admit(1) == 1
    m.on_consume(4)
    m.note_take(waited_s=0.0, surplus=4, now=11.0)
    assert m.lookahead == 1 and m.snapshot().lookahead == 1
    m.set_version(2)
    assert m.capacity() == 4  # (2 + 1 + 1)·4 − 8 − 4; eager would allow (2 + 2 + 1)·4 − 8 − 4 = 8


def test_adaptive_admission_follows_the_bottleneck() -> None:
    """A trainer that keeps waiting raises the lookahead to α (eager's bound); once whole batches sit
    finished it comes back to 1. Staleness of what was started never exceeds what L allowed."""
    b, alpha = 4, 3
    m = StalenessManager(alpha=alpha, batch_size=b, admission="adaptive")
    now = 0.0
    for version in range(12):
        m.set_version(version)
        while m.try_admit(1) is not None:
            pass
        assert m.counters.outstanding <= (m.lookahead + 1) * b
        m.on_consume(b)
        now += 1.0
        slow_rollout = version < 6
        m.note_take(waited_s=0.5 if slow_rollout else 0.0, surplus=0 if slow_rollout else b, now=now)
        if version == 2:  # the first take starts the clock; takes 1 and 2 waited: one step up
            assert m.lookahead == 2
        if version == 5:  # takes 3 and 4 waited: α
            assert m.lookahead == alpha
    assert m.lookahead == 1


def test_eager_admission_keeps_alpha_and_bad_admission_is_named() -> None:
    m = StalenessManager(alpha=2, batch_size=4, admission="eager")
    m.note_take(waited_s=0.0, surplus=0, now=1.0)
    m.note_take(waited_s=0.0, surplus=100, now=2.0)
    assert m.lookahead == 2 and m.capacity() == 12
    with pytest.raises(ValueError, match="admission must be one of tokens, adaptive, eager; got 'lazy'"):
        StalenessManager(alpha=1, batch_size=2, admission="lazy")


def test_buffer_take_reports_its_wait_and_surplus() -> None:
    """take_batch measures its own wait and what stays buffered: takes that waited most of the step
    raise the lookahead; one that left a whole batch finished lowers it."""
    m = StalenessManager(alpha=2, batch_size=2, admission="adaptive")
    buf = SampleBuffer(m)
    m.counters.outstanding = 2
    buf.put(group(0, 0))
    buf.take_batch(2, timeout_s=1)  # first take: the clock starts
    for gid in (1, 2):
        m.counters.outstanding = 2
        threading.Timer(0.3, lambda g=gid: buf.put(group(g, 0))).start()
        buf.take_batch(2, timeout_s=5, poll_s=0.01)  # waited ≈ 0.3 s of a ≈ 0.3 s step
        assert m.lookahead == gid  # the second wait in a row raises it
    m.counters.outstanding = 4
    buf.put(group(3, 0))
    buf.put(group(4, 0))
    time.sleep(0.2)  # the step trains
    buf.take_batch(2, timeout_s=1)  # no wait, group 4 (a whole batch) stays buffered
    assert m.lookahead == 1


# ------------------------------------------------------------------ tokens admission (a fraction of a batch)
@pytest.mark.parametrize("lookahead, alpha, waits, late, starved, floor, expected", [
    # (L, α, takes in a row that waited, late token share of the batch, engines ran dry, min_lookahead) → next L
    (1.5, 2, 0, 0.0, False, 1.0, 1.375),  # no wait: creep down by STEP_DOWN …
    (1.0, 2, 0, 0.0, True, 1.0, 1.0),     # … not below min_lookahead (default: one batch)
    (1.0, 2, 0, 0.0, False, 0.0, 0.875),  # min_lookahead 0: below one batch too
    (0.1, 2, 0, 0.0, True, 0.0, 0.0),     # … never below 0 (rollout only after the push: synchronous)
    (0.5, 2, 1, 0.25, False, 0.0, 0.75),  # below a batch the wait is admission's own: up by the late share
    (0.875, 2, 1, 0.5, True, 0.0, 1.0),   # … but from below, at most to one batch
    (1.0, 2, 2, 0.5, False, 1.0, 1.0),    # a batch ahead, engines busy all along: more only adds staleness
    (1.0, 2, 1, 0.5, True, 1.0, 1.0),     # engines idle but a single wait: a blip
    (1.0, 2, 2, 0.5, True, 1.0, 1.5),     # two waits running and the engines ran dry: up by the late share
    (1.75, 2, 3, 0.5, True, 1.0, 2.0),    # … never past α
    (0.0, 0, 2, 1.0, True, 1.0, 0.0),     # α = 0: synchronous, nothing to move
    (0.0, 0, 0, 0.0, False, 1.0, 0.0),    # … whatever min_lookahead says
])
def test_next_token_lookahead_table(lookahead: float, alpha: int, waits: int, late: float, starved: bool,
                                    floor: float, expected: float) -> None:
    got = next_token_lookahead(lookahead, alpha=alpha, waits_in_a_row=waits, late=late, starved=starved, floor=floor)
    assert got == pytest.approx(expected) and STEP_DOWN == 0.125 and RAISE_AFTER == 2


def test_late_share_counts_the_tokens_that_arrived_during_the_wait() -> None:
    # groups of 5, 5 and 10 response tokens buffered at 1, 2, 3 s; the trainer began waiting at 1.5 s
    assert late_share(tokens=[5, 5, 10], arrived=[1.0, 2.0, 3.0], since=1.5) == pytest.approx(15 / 20)
    assert late_share(tokens=[5, 5], arrived=[1.0, 1.2], since=1.5) == 0.0
    assert late_share(tokens=[], arrived=[], since=0.0) == 0.0


def test_a_fractional_lookahead_admits_whole_samples_of_the_next_batch() -> None:
    # version 3, B = 16, L = 0.875: (3 + 1)·16 + ⌊14⌋ − 48 consumed = 30 may start
    assert capacity(version=3, alpha=0.875, batch_size=16, extra=0, consumed=48, outstanding=0) == 30
    assert capacity(version=3, alpha=0.3, batch_size=16, extra=0, consumed=48, outstanding=0) == 20  # ⌊4.8⌋ = 4
    assert capacity(version=3, alpha=2, batch_size=16, extra=0, consumed=48, outstanding=0) == 48  # = eager's


def test_token_admission_worked_example_of_the_docstring() -> None:
    """B = 4 in groups of 2, α = 2, min_lookahead 0: the "Token lookahead" table in staleness.py, on an
    injected clock."""
    t = time.monotonic()
    m = StalenessManager(alpha=2, batch_size=4, admission="tokens", min_lookahead=0.0)
    assert m.lookahead == 1 and m.capacity() == 8
    # step 0: batches 0 and 1 start; both finish by t+1 (the engines then sit idle); take 0 at t+1
    for _ in range(4):
        assert m.try_admit(2, now=t) == 0
    assert m.try_admit(2, now=t) is None
    for _ in range(4):
        m.on_landed(0, 2, now=t + 1.0)
    m.on_consume(4)
    m.note_take(waited_s=1.0, surplus=4, now=t + 1.0, late=1.0)  # the first take starts the clock
    assert m.lookahead == 1
    # take 1 at t+2, batch 1 ready: no wait → L = 0.875, ⌊3.5⌋ = 3 samples ahead: one group of the next batch
    m.set_version(1)
    m.on_consume(4)
    m.note_take(waited_s=0.0, surplus=0, now=t + 2.0, late=0.0, sit_s=1.0)
    assert m.lookahead == pytest.approx(0.875) and m.capacity() == 3
    assert m.try_admit(2, now=t + 2.0) == 1 and m.try_admit(2, now=t + 2.0) is None
    m.on_landed(1, 2, now=t + 2.5)
    # push → V = 2 at t+3: (2 + 1)·4 + 3 − 8 − 2 = 5: the batch's second group and one of the next start
    m.set_version(2)
    assert m.capacity() == 5
    assert m.try_admit(2, now=t + 3.0) == 2 and m.try_admit(2, now=t + 3.0) == 2
    m.on_landed(2, 2, now=t + 3.4)
    # take 2 at t+3.4 after a 0.4 s wait (past 5 % of the 1.4 s step) for half the batch's tokens
    m.on_consume(4)
    m.note_take(waited_s=0.4, surplus=0, now=t + 3.4, late=0.5, sit_s=0.45)
    assert m.lookahead == pytest.approx(1.0)  # 0.875 + 0.5, but from below one batch at most 1
    c = m.snapshot()
    assert (c.lookahead, c.late_share, c.sit_s) == (1.0, 0.5, 0.45)
    # since take 1 the engines had nothing in flight from 2.5 to 3.0 (the push): 0.5 s
    assert c.starved_s == pytest.approx(0.5)


def test_token_admission_rises_past_one_batch_only_when_the_engines_ran_dry() -> None:
    """At L = 1 a trainer that waits twice running while the engines were busy keeps L (a slow engine,
    not admission); one whose waits follow a step in which the engines sat with nothing admitted gets
    the late share. A single wait never raises L past one batch."""
    t = time.monotonic()
    for idle_before in (0.0, 0.5):
        m = StalenessManager(alpha=2, batch_size=4, admission="tokens")
        assert m.lookahead == 1.0
        m.note_take(waited_s=0.0, surplus=0, now=t + 1.0)  # the clock starts
        assert m.try_admit(4, now=t + 1.0) == 0
        m.note_take(waited_s=0.0, surplus=4, now=t + 2.0)  # no wait: stays at min_lookahead 1
        assert m.lookahead == 1.0
        m.on_landed(0, 4, now=t + 3.0 - idle_before)  # done; the engines idle until the next admission
        assert m.try_admit(4, now=t + 3.0) == 0
        m.note_take(waited_s=0.5, surplus=0, now=t + 3.0, late=0.25)
        assert m.lookahead == 1.0  # one wait: a blip
        m.note_take(waited_s=0.5, surplus=0, now=t + 4.0, late=0.25)  # the second in a row
        assert m.lookahead == pytest.approx(1.25 if idle_before else 1.0)


def test_tokens_admission_starts_one_batch_ahead_within_alpha() -> None:
    assert StalenessManager(alpha=2, batch_size=4, admission="tokens").lookahead == 1.0
    assert StalenessManager(alpha=2, batch_size=4, admission="tokens", min_lookahead=1.5).lookahead == 1.5
    assert StalenessManager(alpha=0, batch_size=4, admission="tokens").capacity() == 4  # α = 0: one batch
    with pytest.raises(ValueError, match="min_lookahead >= 0"):
        StalenessManager(alpha=2, batch_size=4, admission="tokens", min_lookahead=-0.5)


def test_buffer_take_reports_the_late_share_and_how_long_samples_sat() -> None:
    """take_batch hands the rule the tokens that landed while the trainer waited and the mean time the
    batch's samples sat finished: one group (2 samples, 1 token each) buffered 0.2 s before the take
    began, one landing 0.3 s into the wait."""
    m = StalenessManager(alpha=2, batch_size=4, admission="tokens")
    buf = SampleBuffer(m)
    m.counters.outstanding = 4
    buf.put(group(0, 0, t=time.monotonic() - 0.2))
    threading.Timer(0.3, lambda: buf.put(group(1, 0, t=time.monotonic()))).start()
    buf.take_batch(4, timeout_s=5, poll_s=0.01)
    c = m.snapshot()
    assert c.late_share == pytest.approx(0.5)  # 2 of the batch's 4 tokens came during the wait
    # sat: group 0 at least its 0.2 s head start plus the wait, group 1 about nothing → mean over samples ≥ 0.1 s
    assert c.sit_s >= 0.1
