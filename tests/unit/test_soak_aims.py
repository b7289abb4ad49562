"""The soak's step-time aims (benchmarks/soak_aims.py `step_time_aims`) on step rows written by hand: one
slow step of a few medians passes, a step stopped for seconds fails, a fault's window sets its steps
aside, and too few clean steps fail rather than pass over nothing."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from soak_aims import P99_RATIO_LIMIT, STALL_RATIO, step_time_aims  # noqa: E402


def rows(times: list[float], start: float = 100.0) -> list[dict]:
    out, t = [], start
    for dt in times:
        t += dt
        out.append({"_t": t, "time_step": dt})
    return out


def test_limits_are_the_documented_ones() -> None:
    assert (P99_RATIO_LIMIT, STALL_RATIO) == (3.0, 10.0)


def test_one_slow_step_is_not_a_stall() -> None:
    """448 steps at 0.14 s with one of 0.51 s (3.6 medians: what failed the old max/median aim)."""
    times = [0.14] * 447 + [0.51]
    aims = step_time_aims(rows(times), [], warmup_s=0)
    assert aims["step_time_p99_over_median"]["pass"] and aims["step_time_stalls"]["pass"]
    assert aims["step_time_p99_over_median"]["value"]["max_ratio"] == pytest.approx(0.51 / 0.14, abs=0.01)


def test_a_ten_second_stall_fails_and_is_named() -> None:
    times = [0.14] * 200 + [10.14] + [0.14] * 200
    aims = step_time_aims(rows(times), [], warmup_s=0)
    assert not aims["step_time_stalls"]["pass"]
    assert aims["step_time_stalls"]["value"]["steps_over"] == [10.14]
    assert aims["step_time_p99_over_median"]["pass"]  # one step in 401 is not the p99


def test_a_spread_of_slow_steps_fails_the_p99() -> None:
    times = [0.1] * 190 + [0.4] * 10  # 5 % of the steps at 4 medians
    aims = step_time_aims(rows(times), [], warmup_s=0)
    assert not aims["step_time_p99_over_median"]["pass"] and aims["step_time_stalls"]["pass"]


def test_steps_in_a_fault_window_or_the_warm_up_are_set_aside() -> None:
    times = [0.14] * 100 + [10.14] + [0.14] * 100
    r = rows(times)
    stalled_end = r[100]["_t"]
    aims = step_time_aims(r, [(stalled_end - 5.0, stalled_end, "kill")], warmup_s=0)
    assert aims["step_time_stalls"]["pass"] and aims["step_time_p99_over_median"]["value"]["set_aside"] >= 1
    assert step_time_aims(r, [], warmup_s=stalled_end + 1)["step_time_stalls"]["pass"]


def test_too_few_clean_steps_fail() -> None:
    aims = step_time_aims(rows([0.14] * 10), [], warmup_s=0)
    assert not aims["step_time_p99_over_median"]["pass"] and not aims["step_time_stalls"]["pass"]
