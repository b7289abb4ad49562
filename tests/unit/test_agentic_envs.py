"""Agentic environments: built-in envs, ThreadedEnv, the registry, latency/failure injection.

Pure and fast (no Megatron, no torch). Solvability is checked with BFS solvers written here that
read only the rendered observations, and calculator answers with a reference evaluator over
Python's own AST; neither shares code with the envs.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import collections
import inspect
import math
import random
import statistics
import subprocess
import sys
import threading
import time

import pytest

from megatron_flash.agentic import (Env, EnvError, LatencyEnv, StepResult, SyncEnv, ThreadedEnv,
                                    from_config, list_envs, make_env, register_env, unwrap)
from megatron_flash.agentic.envs import calculator as calculator_module
from megatron_flash.agentic.envs.calculator import CalculatorEnv
from megatron_flash.agentic.envs.frozenlake import FrozenLakeEnv
from megatron_flash.agentic.envs.sokoban import SokobanEnv
from megatron_flash.agentic.wrappers import check_latency, lognormal_params, sample_latency

# The CPU test tokenizer's characters, spelled out here rather than imported from the envs.
TINY_ALPHABET = set("0123456789abcdefghijklmnopqrstuvwxyz:=+-,|? ")
MOVES = {"l": (0, -1), "r": (0, 1), "u": (-1, 0), "d": (1, 0)}
NUM_SOLVER_SEEDS = 200


def run(coro):
    return asyncio.run(coro)


def grid_of(observation: str) -> list[str]:
    return observation.split("map:", 1)[1].split("|")


def bfs_path(start, is_goal, neighbours):
    """Fewest-move action list from start to a state with is_goal, or None."""
    prev = {start: None}
    queue = collections.deque([start])
    while queue:
        state = queue.popleft()
        if is_goal(state):
            path = []
            while prev[state] is not None:
                state, action = prev[state]
                path.append(action)
            return path[::-1]
        for action, nxt in neighbours(state):
            if nxt not in prev:
                prev[nxt] = (state, action)
                queue.append(nxt)
    return None


def solve_frozenlake(observation: str):
    rows = grid_of(observation)
    n = len(rows)
    find = lambda ch: next((r, c) for r in range(n) for c in range(n) if rows[r][c] == ch)
    goal = find("g")

    def neighbours(cell):
        for action, (dr, dc) in MOVES.items():
            r, c = min(max(cell[0] + dr, 0), n - 1), min(max(cell[1] + dc, 0), n - 1)
            if rows[r][c] != "h":
                yield action, (r, c)

    return bfs_path(find("p"), lambda cell: cell == goal, neighbours)


def solve_sokoban(observation: str):
    rows = grid_of(observation)
    n = len(rows)
    cells = {(r, c): rows[r][c] for r in range(n) for c in range(n)}
    targets = {cell for cell, ch in cells.items() if ch in "txs"}
    player = next(cell for cell, ch in cells.items() if ch in "ps")
    boxes = frozenset(cell for cell, ch in cells.items() if ch in "bx")
    open_ = lambda cell: cells.get(cell, "w") != "w"

    def neighbours(state):
        pos, bxs = state
        for action, (dr, dc) in MOVES.items():
            nxt = (pos[0] + dr, pos[1] + dc)
            if not open_(nxt):
                continue
            if nxt in bxs:
                beyond = (nxt[0] + dr, nxt[1] + dc)
                if not open_(beyond) or beyond in bxs:
                    continue
                yield action, (nxt, (bxs - {nxt}) | {beyond})
            else:
                yield action, (nxt, bxs)

    return bfs_path((player, boxes), lambda state: state[1] <= targets, neighbours)


def reference_value(question: str) -> int:
    """Value of a question's expression by walking Python's AST ('x' read as '*')."""
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}

    def walk(node):
        if isinstance(node, ast.BinOp):
            return ops[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        assert isinstance(node, ast.Constant) and isinstance(node.value, int), ast.dump(node)
        return node.value

    return walk(ast.parse(question.replace("x", "*"), mode="eval").body)


def question_of(observation: str) -> str:
    return observation.split("question: ", 1)[1].removesuffix(" =?")


# ---------------------------------------------------------------------------------- determinism

@pytest.mark.parametrize("cls,params,actions", [
    (FrozenLakeEnv, {}, "lrudllrrudud"),
    (FrozenLakeEnv, {"slippery": True, "size": 5}, "rrddllururdd"),
    (SokobanEnv, {}, "lrudllrrudud"),
    (SokobanEnv, {"num_boxes": 2, "size": 6}, "uuddlrlrdudu"),
    (CalculatorEnv, {"max_steps": 20}, ["calc:1+2", "calc:3x4", "x", "answer:7"]),
])
def test_same_seed_same_episode(cls, params, actions):
    def episode(seed):
        env = cls(**params)
        trace = [env.reset(seed)]
        for action in actions:
            result = env.step(action)
            trace.append((result.observation, result.reward, result.done, result.info))
            if result.done:
                break
        return trace

    for seed in (0, 7, 123456):
        assert episode(seed) == episode(seed)
    firsts = {cls(**params).reset(seed) for seed in range(30)}
    assert len(firsts) > 20, "different seeds should give different tasks"


def test_slippery_slips_reproducibly():
    env = FrozenLakeEnv(slippery=True, hole_prob=0.0, size=6)
    moved = []
    for seed in range(30):
        env.reset(seed)
        for _ in range(5):
            result = env.step("r")
            moved.append(result.info["moved"])
            if result.done:
                break
    share_intended = moved.count("r") / len(moved)
    assert 0.2 < share_intended < 0.5, share_intended  # 1/3 expected
    assert set(moved) == {"r", "u", "d"}


# ------------------------------------------------------------------------------------ frozenlake

def test_frozenlake_levels_solvable_and_solved_through_step():
    env = FrozenLakeEnv()
    for seed in range(NUM_SOLVER_SEEDS):
        first = env.reset(seed)
        path = solve_frozenlake(first)
        assert path is not None, f"seed {seed}: no path in {first}"
        assert 1 <= len(path) <= env.max_steps
        for i, action in enumerate(path):
            result = env.step(action)
            assert result.done == (i == len(path) - 1)
        assert result.reward == 1.0 and result.info["success"], (seed, first, path)
    big = FrozenLakeEnv(size=8, hole_prob=0.3, max_steps=20)
    for seed in range(20):
        path = solve_frozenlake(big.reset(seed))
        assert path is not None and len(path) <= 20


def test_frozenlake_hole_step_penalty_and_edge():
    env = FrozenLakeEnv(step_penalty=-0.05, hole_prob=0.4)
    found_hole = False
    for seed in range(100):
        rows = grid_of(env.reset(seed))
        r, c = next((r, c) for r in range(4) for c in range(4) if rows[r][c] == "p")
        for action, (dr, dc) in MOVES.items():
            if 0 <= r + dr < 4 and 0 <= c + dc < 4 and rows[r + dr][c + dc] == "h":
                result = env.step(action)
                assert (result.reward, result.done, result.info["success"]) == (0.0, True, False)
                found_hole = True
                break
        else:
            continue
        break
    assert found_hole
    # a move into the edge: the player stays, an ordinary step
    env = FrozenLakeEnv(step_penalty=-0.05, hole_prob=0.0)
    for seed in range(100):
        rows = grid_of(env.reset(seed))
        if "p" in rows[0]:
            result = env.step("up")
            assert grid_of(result.observation) == rows
            assert (result.reward, result.done) == (-0.05, False)
            break
    else:
        pytest.fail("no start on the top row in 100 seeds")


def test_invalid_actions_penalty_and_truncation():
    env = FrozenLakeEnv(invalid_penalty=-0.5, max_steps=3)
    first = env.reset(1)
    state = first.split(" map:")[1]
    for text in ("", "jump", "dl", "LEFTish", "12"):
        env.reset(1)
        result = env.step(text)
        assert result.observation == "invalid map:" + state
        assert (result.reward, result.done) == (-0.5, False)
        assert result.info == {"invalid": True, "success": False, "truncated": False}
    env.reset(1)
    env.step("?"), env.step("?")
    last = env.step("?")  # invalid steps count towards max_steps
    assert last.done and last.info["truncated"] and not last.info["success"]
    with pytest.raises(EnvError):
        env.step("l")

    ender = SokobanEnv(end_on_invalid=True, invalid_penalty=-1.0)
    ender.reset(0)
    result = ender.step("please push the box")
    assert (result.reward, result.done, result.info["invalid"]) == (-1.0, True, True)


@pytest.mark.parametrize("text,action", [
    ("d", "d"), ("Down", "d"), ("move: down", "d"), ("i go left then up", "l"), ("u,r", "u"),
    ("action:r", "r"), ("download", None), ("dl", None), ("go 3 steps", None), ("", None),
])
def test_direction_parse_rule(text, action):
    env = FrozenLakeEnv(hole_prob=0.0, size=3)
    assert env.parse_action(text) == action


# --------------------------------------------------------------------------------------- sokoban

@pytest.mark.parametrize("params,num_seeds", [({}, NUM_SOLVER_SEEDS),
                                              ({"size": 6, "num_boxes": 2}, 25)])
def test_sokoban_levels_solvable_and_solved_through_step(params, num_seeds):
    env = SokobanEnv(**params)
    for seed in range(num_seeds):
        first = env.reset(seed)
        path = solve_sokoban(first)
        assert path is not None, f"seed {seed}: unsolvable {first}"
        assert 1 <= len(path) <= env.num_reverse_steps <= env.max_steps
        for action in path:
            result = env.step(action)
        assert result.done and result.reward == 1.0 and result.info["success"], (seed, first, path)
        assert result.info["boxes_on_target"] == env.num_boxes


def test_sokoban_blocked_push_and_box_shaping():
    env = SokobanEnv(box_reward=0.1, step_penalty=-0.01, num_boxes=2, size=6)
    checked_blocked = checked_off = False
    for seed in range(200):
        first = env.reset(seed)
        rows = grid_of(first)
        cells = {(r, c): rows[r][c] for r in range(6) for c in range(6)}
        player = next(cell for cell, ch in cells.items() if ch in "ps")
        for action, (dr, dc) in MOVES.items():
            box = (player[0] + dr, player[1] + dc)
            beyond = (box[0] + dr, box[1] + dc)
            if cells.get(box) not in ("b", "x"):
                continue
            env.reset(seed)
            result = env.step(action)
            if cells.get(beyond, "w") in "wbx":  # blocked: nothing moves
                assert grid_of(result.observation) == rows and result.reward == -0.01
                checked_blocked = True
            elif cells[box] == "x":  # pushed off its target
                assert result.reward == pytest.approx(-0.01 - 0.1)
                checked_off = True
    assert checked_blocked and checked_off
    # onto a target: the solver's first push that raises boxes_on_target (without solving)
    for seed in range(200):
        first = env.reset(seed)
        before = first.count("x")
        for action in solve_sokoban(first):
            result = env.step(action)
            if not result.done and result.info["boxes_on_target"] == before + 1:
                assert result.reward == pytest.approx(-0.01 + 0.1)
                return
            before = result.info["boxes_on_target"]
    pytest.fail("no push onto a target found")


# ------------------------------------------------------------------------------------ calculator

@pytest.mark.parametrize("params", [{}, {"difficulty": 4}, {"difficulty": 5, "parentheses": True},
                                    {"difficulty": 1, "mul_symbol": "*"}])
def test_calculator_answers_and_tool_results(params):
    env = CalculatorEnv(**params)
    for seed in range(100):
        question = question_of(env.reset(seed))
        truth = reference_value(question)
        tool = env.step(f"calc:{question}")
        assert tool.observation == f"result:{truth}" and not tool.done and tool.reward == 0.0
        assert tool.info["tool_call"] and "tool_error" not in tool.info
        result = env.step(f"the answer:{truth}")
        assert (result.observation, result.reward, result.done) == ("correct", 1.0, True)
        assert result.info["success"]
        env.reset(seed)
        result = env.step(f"answer: {truth + 1}")
        assert (result.observation, result.reward, result.done) == ("incorrect", 0.0, True)
        assert not result.info["success"]


@pytest.mark.parametrize("expr,expected", [
    ("2+3x4", "result:14"), ("(2+3)*4", "result:20"), ("-3 - -4", "result:1"), ("7-10", "result:-3"),
    ("2*(3", "error:unbalanced parentheses"), ("2)", "error:unbalanced parentheses"),
    ("", "error:empty expression"), ("3+", "error:bad expression"), ("4 4", "error:bad expression"),
    ("x", "error:bad expression"), ("9" * 101, "error:too long"),
])
def test_calculator_tool_arguments(expr, expected):
    env = CalculatorEnv(max_steps=3)
    env.reset(0)
    result = env.step(f"calc:{expr}")
    assert result.observation == expected and result.reward == 0.0 and not result.done
    if expected.startswith("error:"):
        assert result.info["tool_error"] == expected.removeprefix("error:")
    assert not result.info["invalid"]


def test_calculator_never_evals(monkeypatch):
    tree = ast.parse(inspect.getsource(calculator_module))
    called = {node.func.id for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert not called & {"eval", "exec", "compile", "__import__"}

    def forbidden(*args, **kwargs):
        raise AssertionError("eval/exec called")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    env = CalculatorEnv()
    env.reset(3)
    for text in ("calc:__import__('os').system('true')", "calc:1+1", "calc:(1)x(2)"):
        result = env.step(text)
        assert result.observation in ("error:empty expression", "result:2")


def test_calculator_invalid_and_truncation():
    env = CalculatorEnv(max_steps=2, invalid_penalty=-0.1)
    first = env.reset(5)
    for text in ("37", "answer:", "answer:abc", "calculate 3+4"):
        env.reset(5)
        result = env.step(text)
        assert result.info["invalid"] and result.reward == -0.1 and not result.done
        assert result.observation == "invalid " + first.split(" ", 5)[-1]
    env.reset(5)
    env.step("calc:1+1")
    result = env.step("calc:2+2")
    assert result.done and result.info["truncated"] and result.reward == 0.0


# ---------------------------------------------------------------------------------- all built-ins

@pytest.mark.parametrize("name,params", [("frozenlake", {}), ("frozenlake", {"slippery": True}),
                                         ("sokoban", {}), ("sokoban", {"num_boxes": 2}),
                                         ("calculator", {}), ("calculator", {"difficulty": 6})])
def test_observations_use_only_the_tiny_alphabet(name, params):
    cls = unwrap(make_env(name, **params)).__class__
    rng = random.Random(0)
    for seed in range(60):
        env = cls(**params, max_steps=8)
        texts = [env.reset(seed)]
        for i in range(8):
            action = cls.random_valid_action(rng) if i % 3 else "???"
            assert set(action) <= TINY_ALPHABET, action
            result = env.step(action)
            texts.append(result.observation)
            if not i % 3:
                assert result.info["invalid"]
            else:
                assert not result.info["invalid"], action
            if result.done:
                break
        for text in texts:
            assert set(text) <= TINY_ALPHABET, (name, seed, text)


# ------------------------------------------------------------------------------------ ThreadedEnv

class SleepyEnv(SyncEnv):
    """Blocks its thread for `seconds` in every step."""

    def __init__(self, seconds: float = 0.2) -> None:
        self.seconds = seconds
        self.threads: set[str] = set()

    def reset(self, seed: int) -> str:
        return f"seed:{seed}"

    def step(self, action_text: str) -> StepResult:
        self.threads.add(threading.current_thread().name)
        time.sleep(self.seconds)
        return StepResult(observation=action_text, reward=1.0, done=True)


def test_threaded_env_does_not_block_the_loop():
    async def main():
        async def ticker(stop: asyncio.Event) -> int:
            ticks = 0
            while not stop.is_set():
                await asyncio.sleep(0.01)
                ticks += 1
            return ticks

        one = ThreadedEnv(SleepyEnv())
        assert await one.reset(3) == "seed:3"
        t0 = time.perf_counter()
        await one.step("a")
        single = time.perf_counter() - t0

        envs = [ThreadedEnv(SleepyEnv()), ThreadedEnv(SleepyEnv())]
        stop = asyncio.Event()
        ticks = asyncio.create_task(ticker(stop))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(env.step(str(i)) for i, env in enumerate(envs)))
        both = time.perf_counter() - t0
        stop.set()
        assert [r.observation for r in results] == ["0", "1"]
        assert both < 1.5 * single, (both, single)  # serial would be ~2x
        assert await ticks >= 0.25 * single / 0.01, "the loop stalled while steps blocked"
        assert threading.main_thread().name not in envs[0].env.threads
        for env in envs + [one]:
            await env.close()

    run(main())


def test_threaded_env_abandoned_call_then_close():
    release = threading.Event()
    calls: list[str] = []

    class Stuck(SyncEnv):
        def reset(self, seed: int) -> str:
            return "ok"

        def step(self, action_text: str) -> StepResult:
            calls.append("step")
            release.wait(5)
            return StepResult("s", 0.0, False)

        def close(self) -> None:
            calls.append("close")

    async def main():
        env = ThreadedEnv(Stuck())
        await env.reset(0)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(env.step("x"), 0.05)
        t0 = time.perf_counter()
        await env.close()  # does not wait for the stuck step
        assert time.perf_counter() - t0 < 0.5 and calls == ["step"]
        with pytest.raises(EnvError):
            await env.step("y")
        release.set()
        for _ in range(100):
            if "close" in calls:
                break
            await asyncio.sleep(0.01)
        assert calls == ["step", "close"]

    run(main())


# --------------------------------------------------------------------------------------- registry

class EchoEnv(Env):
    async def reset(self, seed: int) -> str:
        return f"echo {seed}"

    async def step(self, action_text: str) -> StepResult:
        return StepResult(action_text, 0.0, True)


def test_registry_builtins_unknown_and_bad_params():
    assert {"frozenlake", "sokoban", "calculator"} <= set(list_envs())
    env = make_env("frozenlake", size=5)
    assert isinstance(env, ThreadedEnv) and isinstance(env.env, FrozenLakeEnv)
    assert run(env.reset(0)).count("|") == 4
    with pytest.raises(ValueError, match=r"unknown env 'frozen'.*calculator.*frozenlake.*sokoban"):
        make_env("frozen")
    with pytest.raises(ValueError, match=r"'frozenlake'.*'sise'"):
        make_env("frozenlake", sise=4)
    with pytest.raises(ValueError, match=r"'sokoban'.*num_boxes"):
        make_env("sokoban", num_boxes=0)
    with pytest.raises(ValueError, match=r"'calculator'.*mul_symbol"):
        make_env("calculator", mul_symbol="/")
    with pytest.raises(ValueError, match="already registered"):
        register_env("sokoban")(EchoEnv)


def test_registry_user_envs(tmp_path, monkeypatch):
    register_env("test_echo_env")(EchoEnv)
    env = make_env("test_echo_env")
    assert env.__class__ is EchoEnv and run(env.reset(4)) == "echo 4"

    @register_env("test_echo_factory")
    def factory(*, prefix: str = "hi"):
        return SleepyEnv(0.0) if prefix == "sync" else EchoEnv()

    assert isinstance(make_env("test_echo_factory", prefix="sync"), ThreadedEnv)
    with pytest.raises(ValueError, match=r"'test_echo_factory'.*'suffix'"):
        make_env("test_echo_factory", suffix="x")

    (tmp_path / "my_user_envs.py").write_text(
        "from megatron_flash.agentic import SyncEnv, StepResult\n"
        "class Guess(SyncEnv):\n"
        "    def __init__(self, *, high: int = 9):\n"
        "        self.high = high\n"
        "    def reset(self, seed):\n"
        "        self.secret = seed % (self.high + 1)\n"
        "        return f'guess 0..{self.high}'\n"
        "    def step(self, action_text):\n"
        "        ok = action_text.strip() == str(self.secret)\n"
        "        return StepResult('yes' if ok else 'no', float(ok), ok, {'success': ok})\n"
        "def not_an_env():\n"
        "    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    guess = make_env("my_user_envs:Guess", high=5)
    assert isinstance(guess, ThreadedEnv)

    async def play():
        assert await guess.reset(8) == "guess 0..5"
        return await guess.step("2")

    assert run(play()).info["success"]
    with pytest.raises(ValueError, match=r"'my_user_envs:Guess'.*'low'"):
        make_env("my_user_envs:Guess", low=1)
    with pytest.raises(ValueError, match="cannot import"):
        make_env("my_user_envs:Missing")
    with pytest.raises(ValueError, match="expected an Env or SyncEnv"):
        make_env("my_user_envs:not_an_env")


def test_agentic_package_imports_no_torch():
    code = ("import sys, asyncio; from megatron_flash.agentic import make_env, list_envs; "
            "[asyncio.run(make_env(n).reset(0)) for n in list_envs()]; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ------------------------------------------------------------------------------------- LatencyEnv

class CountingEnv(Env):
    def __init__(self) -> None:
        self.calls = 0

    async def reset(self, seed: int) -> str:
        self.calls += 1
        return "start"

    async def step(self, action_text: str) -> StepResult:
        self.calls += 1
        return StepResult("obs", 0.0, False)


def recorded_delays(num_steps: int, **kwargs) -> list[float]:
    delays: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        delays.append(seconds)

    async def main():
        env = LatencyEnv(CountingEnv(), sleep=fake_sleep, **kwargs)
        for _ in range(num_steps):
            await env.step("a")

    run(main())
    return delays


@pytest.mark.parametrize("mean_s,std_s", [(1.0, 1.0), (0.05, 0.02), (2.0, 0.5), (0.3, 3.0)])
def test_lognormal_conversion(mean_s, std_s):
    mu, sigma = lognormal_params(mean_s, std_s)
    assert math.exp(mu + sigma ** 2 / 2) == pytest.approx(mean_s)
    variance = (math.exp(sigma ** 2) - 1) * math.exp(2 * mu + sigma ** 2)
    assert math.sqrt(variance) == pytest.approx(std_s)


@pytest.mark.parametrize("dist,mean_s,std_s,mean_tol,std_tol", [
    ("constant", 0.2, 0.0, 1e-12, 1e-12),
    ("normal", 0.5, 0.1, 0.01, 0.01),
    ("lognormal", 1.0, 1.0, 0.06, 0.15),
    ("lognormal", 0.05, 0.02, 0.002, 0.002),
])
def test_latency_env_delay_statistics(dist, mean_s, std_s, mean_tol, std_tol):
    spec = {"dist": dist, "mean_s": mean_s, "std_s": std_s}
    delays = recorded_delays(20_000, step_latency=spec, seed=1)
    assert len(delays) == 20_000 and min(delays) >= 0
    assert statistics.fmean(delays) == pytest.approx(mean_s, abs=mean_tol)
    assert statistics.pstdev(delays) == pytest.approx(std_s, abs=std_tol)
    assert recorded_delays(50, step_latency=spec, seed=1) == delays[:50]  # seeded


def test_latency_env_normal_is_clipped_at_zero():
    delays = recorded_delays(5000, step_latency={"dist": "normal", "mean_s": 0.01, "std_s": 0.05})
    assert min(delays) >= 0.0 and max(delays) > 0.05


def test_latency_env_really_sleeps_and_delays_resets():
    async def main():
        env = LatencyEnv(CountingEnv(), step_latency=0.05, reset_latency=0.1)
        t0 = time.perf_counter()
        await env.reset(0)
        t1 = time.perf_counter()
        await env.step("a")
        t2 = time.perf_counter()
        assert t1 - t0 >= 0.1 and 0.05 <= t2 - t1 < 0.1 + 0.5

    run(main())


def test_latency_env_failures_and_hangs():
    async def main():
        inner = CountingEnv()
        env = LatencyEnv(inner, step_latency=None, failure_prob=0.2, seed=3)
        failures = 0
        for _ in range(5000):
            try:
                await env.step("a")
            except EnvError:
                failures += 1
        assert 0.18 < failures / 5000 < 0.22 and env.num_failures == failures
        assert inner.calls == 5000 - failures  # a failing call never reaches the env

        hanging = LatencyEnv(CountingEnv(), step_latency=None, reset_latency=0.0, hang_prob=1.0)
        t0 = time.perf_counter()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(hanging.step("a"), 0.1)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(hanging.reset(0), 0.1)
        assert time.perf_counter() - t0 < 1.0
        assert hanging.env.calls == 0 and hanging.num_hangs == 2

    run(main())


def test_latency_from_config_and_validation():
    inner = CountingEnv()
    assert from_config(inner, {}) is inner and from_config(inner, None) is inner
    cfg = {"step_latency": {"dist": "normal", "mean_s": 0.05, "std_s": 0.05}, "failure_prob": 0.01}
    wrapped = from_config(inner, cfg, seed=7)
    assert isinstance(wrapped, LatencyEnv) and wrapped.env is inner and wrapped.failure_prob == 0.01
    assert unwrap(wrapped) is inner
    # without a seed, instances differ (no lockstep); with one, they repeat
    spec = {"step_latency": {"dist": "lognormal", "mean_s": 1.0, "std_s": 1.0}}
    draws = lambda env: [sample_latency(env.step_latency, env._rng) for _ in range(3)]
    assert draws(LatencyEnv.from_config(inner, spec)) != draws(LatencyEnv.from_config(inner, spec))
    assert draws(from_config(inner, spec, seed=5)) == draws(from_config(inner, spec, seed=5))
    with pytest.raises(ValueError, match="step_latancy"):
        from_config(inner, {"step_latancy": 1.0})
    with pytest.raises(ValueError, match=r"step_latency\.dist"):
        from_config(inner, {"step_latency": {"dist": "gamma", "mean_s": 1.0}})
    with pytest.raises(ValueError, match=r"reset_latency\.mean_s"):
        LatencyEnv(inner, step_latency=None, reset_latency={"dist": "normal", "mean_s": -1.0})
    with pytest.raises(ValueError, match="hang_prob"):
        LatencyEnv(inner, step_latency=None, hang_prob=1.5)
    assert check_latency(0.25) == {"dist": "constant", "mean_s": 0.25, "std_s": 0.0}
    assert sample_latency(None, random.Random(0)) == 0.0


def test_env_thread_pool_size():
    from megatron_flash.agentic import env_thread_pool, set_env_thread_pool_size
    from megatron_flash.agentic.protocol import DEFAULT_ENV_THREADS

    with pytest.raises(ValueError, match="num_threads"):
        set_env_thread_pool_size(0)
    try:
        set_env_thread_pool_size(3)
        assert env_thread_pool()._max_workers == 3
        env = ThreadedEnv(SleepyEnv(0.0))
        assert run(env.step("a")).observation == "a"
    finally:
        set_env_thread_pool_size(DEFAULT_ENV_THREADS)
