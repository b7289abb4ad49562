"""Reward registry, the built-in rewards, and RewardPool (inline and with spawned workers).

User rewards for the worker tests live in a module written to tmp_path and named as
"module:function": spawned workers inherit sys.path and import it by name.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest

from megatron_flash.rewards import (
    RewardOutcome,
    RewardPool,
    get_reward,
    list_rewards,
    register_reward,
)
from megatron_flash.rewards import registry

USER_REWARDS = """
import time

def contains(response_text, answer, *, finished, prompt="", meta=None):
    return 1.0 if finished and answer in response_text else 0.0

def boom(response_text, answer, *, finished, prompt="", meta=None):
    raise RuntimeError("kaboom " + answer)

def verify_timeout(response_text, answer, *, finished, prompt="", meta=None):
    from math_verify.errors import TimeoutException  # a BaseException, not an Exception
    raise TimeoutException("Operation timed out!")

def sleepy(response_text, answer, *, finished, prompt="", meta=None):
    time.sleep(float(answer))
    return 1.0

def pid(response_text, answer, *, finished, prompt="", meta=None):
    import os
    return float(os.getpid())

def not_a_number(response_text, answer, *, finished, prompt="", meta=None):
    return {"nan": float("nan"), "str": "1.0", "none": None}[answer]
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    (tmp_path / "my_user_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_user_rewards"
    sys.modules.pop("my_user_rewards", None)


def test_exact_match() -> None:
    fn = get_reward("exact_match")
    assert fn("1234", "1234", finished=True) == 1.0
    assert fn("1234", "1234", finished=False) == 0.0  # no end token: the answer is not complete
    assert fn("12345", "1234", finished=True) == 0.0
    assert fn("1234", "1234", finished=True, prompt="3142:", meta={"task": "sort4"}) == 1.0


@pytest.mark.parametrize("response, gold, expected", [
    ("so the answer is \\boxed{1/2}", "0.5", 1.0),
    ("0.5", "\\boxed{1/2}", 1.0),
    ("$\\frac{1}{2}$", "1/2", 1.0),
    ("The answer is 72.", "72", 1.0),
    ("$\\sqrt{8}$", "2\\sqrt{2}", 1.0),  # a bare LaTeX gold answer is read as LaTeX, not as "2"
    ("\\boxed{3}", "4", 0.0),
    ("\\boxed{2}", "2\\sqrt{2}", 0.0),
    ("I don't know", "7", 0.0),
])
def test_math(response, gold, expected) -> None:
    assert get_reward("math")(response, gold, finished=True) == expected


def test_math_truncated_response_scores_zero() -> None:
    assert get_reward("math")("\\boxed{1/2}", "0.5", finished=False) == 0.0


def test_math_from_a_non_main_thread() -> None:
    # math-verify's signal-based timeouts raise ValueError off the main thread unless disabled.
    results: list[object] = []

    def run() -> None:
        try:
            results.append(get_reward("math")("\\boxed{\\frac{3}{4}}", "0.75", finished=True))
            results.append(asyncio.run(RewardPool("math").score("$1/3$", "0.5", finished=True)))
        except Exception as e:  # surfaced below
            results.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert results == [1.0, RewardOutcome(0.0, False)]


def test_math_does_not_import_math_verify_until_used() -> None:
    code = ("import sys; from megatron_flash.rewards import get_reward; get_reward('math'); "
            "get_reward('exact_match')('a', 'a', finished=True); "
            "assert 'math_verify' not in sys.modules; get_reward('math')('1', '1', finished=True); "
            "assert 'math_verify' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_register_and_lookup() -> None:
    name = "test_rewards_contains_answer"

    @register_reward(name)
    def contains_answer(response_text, answer, *, finished, prompt="", meta=None):
        return float(answer in response_text)

    try:
        assert get_reward(name) is contains_answer
        assert name in list_rewards() and {"exact_match", "math"} <= set(list_rewards())
        with pytest.raises(ValueError, match="already registered"):
            register_reward(name)(contains_answer)
    finally:
        registry._REWARDS.pop(name)
    with pytest.raises(ValueError, match="without ':'"):
        register_reward("a:b")


def test_unknown_reward_lists_known_names() -> None:
    with pytest.raises(ValueError) as err:
        get_reward("exact_mach")
    assert "'exact_mach'" in str(err.value) and "exact_match" in str(err.value) and "math" in str(err.value)
    with pytest.raises(ValueError, match="cannot import"):
        get_reward("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="unknown reward"):
        RewardPool("exact_mach")


def test_module_function_form(user_module) -> None:
    fn = get_reward(f"{user_module}:contains")
    assert fn("xx42yy", "42", finished=True) == 1.0 and fn("xx4yy", "42", finished=True) == 0.0


def test_inline_pool(user_module) -> None:
    async def main(pool: RewardPool) -> list[RewardOutcome]:
        return [await pool.score("1234", "1234", finished=True),
                await pool.score("1243", "1234", finished=True),
                await pool.score("1234", "1234", finished=False)]

    with RewardPool("exact_match") as pool:
        assert asyncio.run(main(pool)) == [RewardOutcome(1.0, False), RewardOutcome(0.0, False),
                                           RewardOutcome(0.0, False)]
        assert (pool.num_scored, pool.num_failed) == (3, 0)

    with RewardPool(f"{user_module}:boom") as pool:
        outcome = asyncio.run(pool.score("x", "7", finished=True))
        assert outcome.failed and outcome.reward == 0.0
        assert "boom" in outcome.error and "RuntimeError" in outcome.error and "kaboom 7" in outcome.error
        assert (pool.num_scored, pool.num_failed) == (1, 1)

    with RewardPool(f"{user_module}:verify_timeout") as pool:
        outcome = asyncio.run(pool.score("x", "7", finished=True))
        assert outcome.failed and "TimeoutException" in outcome.error and pool.num_failed == 1

    with RewardPool(f"{user_module}:not_a_number") as pool:
        outcomes = [asyncio.run(pool.score("x", a, finished=True)) for a in ("nan", "str", "none")]
        assert [o.failed for o in outcomes] == [True, True, True]
        assert "nan" in outcomes[0].error and "'1.0'" in outcomes[1].error and "None" in outcomes[2].error



def test_inline_deadline_fails_a_hung_reward_on_time_and_carries_on(user_module) -> None:
    with RewardPool(f"{user_module}:sleepy", timeout_s=1.0) as pool:
        assert asyncio.run(pool.score("x", "0", finished=True)) == RewardOutcome(1.0, False)
        start = time.monotonic()
        stuck = asyncio.run(pool.score("x", "60", finished=True))
        assert time.monotonic() - start < 15  # the reward would sleep 60 s
        assert stuck.failed and stuck.reward == 0.0 and "timed out after 1.0 s" in stuck.error
        assert stuck.timed_out  # told apart from a reward that raised (metric reward_timeouts)
        assert pool.num_abandoned == 1
        # a fresh thread scores the next sample normally
        assert asyncio.run(pool.score("x", "0", finished=True)) == RewardOutcome(1.0, False)
        assert (pool.num_scored, pool.num_failed) == (3, 1)


def test_inline_deadline_counts_from_each_calls_start_not_its_place_in_the_queue(user_module) -> None:
    async def together(pool: RewardPool, answers: list[str]) -> list[RewardOutcome]:
        return list(await asyncio.gather(*(pool.score("x", a, finished=True) for a in answers)))

    with RewardPool(f"{user_module}:sleepy", timeout_s=1.5) as pool:
        # one at a time: the third starts ~1.2 s after it was submitted, and takes 0.6 s of its own
        start = time.monotonic()
        outcomes = asyncio.run(together(pool, ["0.6", "0.6", "0.6"]))
        assert outcomes == [RewardOutcome(1.0, False)] * 3 and time.monotonic() - start >= 1.8
        # the calls queued behind a hung one run on the thread that replaces it
        outcomes = asyncio.run(together(pool, ["60", "0", "0"]))
        assert outcomes[0].failed and "timed out" in outcomes[0].error
        assert outcomes[1:] == [RewardOutcome(1.0, False)] * 2 and pool.num_abandoned == 1


def test_worker_pool(user_module) -> None:
    async def score_all(pool: RewardPool, items: list[tuple[str, str]]) -> list[RewardOutcome]:
        return list(await asyncio.gather(*(pool.score(r, a, finished=True) for r, a in items)))

    with RewardPool("math", num_workers=2) as pool:
        items = [("\\boxed{1/2}", "0.5"), ("$0.25$", "1/4"), ("\\boxed{3}", "4"), ("so 72", "72")]
        outcomes = asyncio.run(score_all(pool, items))
        assert [o.reward for o in outcomes] == [1.0, 1.0, 0.0, 1.0]
        assert not any(o.failed for o in outcomes) and (pool.num_scored, pool.num_failed) == (4, 0)

    with RewardPool(f"{user_module}:boom", num_workers=2) as pool:
        outcome = asyncio.run(pool.score("x", "3", finished=True))
        assert outcome.failed and "kaboom 3" in outcome.error and pool.num_failed == 1
        assert not outcome.timed_out

    with RewardPool(f"{user_module}:pid", num_workers=2) as pool:  # really scored in the workers
        pids = {o.reward for o in asyncio.run(score_all(pool, [("x", "y")] * 6))}
        assert os.getpid() not in pids and pids <= {float(w.pid) for w in pool._workers}


def test_worker_timeout_kills_and_replaces_the_worker(user_module) -> None:
    with RewardPool(f"{user_module}:sleepy", num_workers=1, timeout_s=1.0) as pool:
        assert asyncio.run(pool.score("x", "0", finished=True)) == RewardOutcome(1.0, False)
        pid = pool._workers[0].pid
        start = time.monotonic()
        stuck = asyncio.run(pool.score("x", "60", finished=True))
        assert time.monotonic() - start < 15  # the reward would sleep 60 s
        assert stuck.failed and stuck.reward == 0.0 and "timed out" in stuck.error and "sleepy" in stuck.error
        assert stuck.timed_out
        # the next sample gets a fresh process and scores normally
        assert asyncio.run(pool.score("x", "0", finished=True)) == RewardOutcome(1.0, False)
        assert pool._workers[0].pid not in (0, pid)
        assert (pool.num_scored, pool.num_failed) == (3, 1)


def test_reward_registered_only_in_the_parent_fails_in_workers() -> None:
    name = "test_rewards_parent_only"
    register_reward(name)(lambda response_text, answer, *, finished, prompt="", meta=None: 1.0)
    try:
        with RewardPool(name, num_workers=1) as pool:
            outcomes = [asyncio.run(pool.score("x", "y", finished=True)) for _ in range(2)]
        assert [(o.reward, o.failed) for o in outcomes] == [(0.0, True)] * 2
        assert all("not known in the worker process" in o.error for o in outcomes)
        with RewardPool(name) as pool:  # inline it exists
            assert asyncio.run(pool.score("x", "y", finished=True)) == RewardOutcome(1.0, False)
    finally:
        registry._REWARDS.pop(name)


def test_closed_pool_refuses_work() -> None:
    pool = RewardPool("exact_match")
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(pool.score("a", "a", finished=True))

