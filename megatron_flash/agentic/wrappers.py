"""Latency and failure injection around any ``Env``, for tests and env-level-async benchmarks.

``LatencyEnv`` delays each ``reset``/``step`` by a random time (``asyncio.sleep``: the loop stays
free, as with a remote environment), and makes a call fail or hang with given probabilities::

    env = LatencyEnv(make_env("frozenlake"), step_latency={"dist": "lognormal", "mean_s": 1.0,
                     "std_s": 1.0}, failure_prob=0.01, hang_prob=0.001, seed=env_index)

Per call, in order: one uniform draw u decides the fault (u < failure_prob: fail; failure_prob <=
u < failure_prob + hang_prob: hang), then the delay is drawn (also for a failing call: a fault
reported after a delay, like a remote env's). A failing call sleeps its delay and raises
``EnvError``; a hanging call waits until it is cancelled (e.g. by the manager's
``asyncio.wait_for`` timeout) and never reaches the wrapped env. All draws come from the wrapper's
own ``random.Random(seed)``, so one seed gives one sequence of delays and faults for a given call
order; give each env instance its own seed, or all of them wait in lockstep.

A latency spec (``Latency``) is a mapping ``{dist, mean_s, std_s}`` or a bare number (constant):

  constant   always mean_s (std_s must be 0 or absent)
  normal     max(0, N(mean_s, std_s^2)); the clip at 0 raises the true mean a little when std_s
             is comparable to mean_s (std_s = mean_s: mean ≈ 1.08 mean_s)
  lognormal  exp(N(mu, sigma^2)) with sigma^2 = ln(1 + std_s^2 / mean_s^2) and
             mu = ln(mean_s) - sigma^2 / 2, so that its mean is mean_s and its std is std_s
             (E = exp(mu + sigma^2/2), Var = (exp(sigma^2) - 1) exp(2 mu + sigma^2))
"""

from __future__ import annotations

import asyncio
import itertools
import math
import numbers
import random
from typing import Any, Awaitable, Callable, Literal, Mapping, Optional, TypedDict, Union

from megatron_flash.agentic.protocol import Env, EnvError, StepResult

LATENCY_DISTS = ("constant", "normal", "lognormal")


class Latency(TypedDict, total=False):
    dist: Literal["constant", "normal", "lognormal"]
    mean_s: float
    std_s: float


LatencySpec = Union[Latency, float, int, None]


def lognormal_params(mean_s: float, std_s: float) -> tuple[float, float]:
    """(mu, sigma) of the lognormal distribution whose mean is mean_s and std is std_s."""
    if mean_s <= 0:
        raise ValueError(f"lognormal latency needs mean_s > 0, got {mean_s}")
    sigma2 = math.log1p((std_s / mean_s) ** 2)
    return math.log(mean_s) - sigma2 / 2, math.sqrt(sigma2)


def check_latency(spec: LatencySpec, *, name: str = "latency") -> Optional[Latency]:
    """The spec as a validated ``Latency`` dict (None stays None); ValueError naming the field."""
    if spec is None:
        return None
    if isinstance(spec, numbers.Real) and not isinstance(spec, bool):
        spec = {"dist": "constant", "mean_s": float(spec)}
    if not isinstance(spec, Mapping):
        raise ValueError(f"{name} must be a mapping {{dist, mean_s, std_s}} or a number, got {spec!r}")
    unknown = set(spec) - {"dist", "mean_s", "std_s"}
    if unknown:
        raise ValueError(f"{name} has unknown keys {sorted(unknown)}; expected dist, mean_s, std_s")
    dist = spec.get("dist", "constant")
    if dist not in LATENCY_DISTS:
        raise ValueError(f"{name}.dist must be one of {', '.join(LATENCY_DISTS)}, got {dist!r}")
    values = {}
    for key in ("mean_s", "std_s"):
        value = spec.get(key, 0.0)
        if (isinstance(value, bool) or not isinstance(value, numbers.Real)
                or not math.isfinite(value) or value < 0):
            raise ValueError(f"{name}.{key} must be a finite number >= 0, got {value!r}")
        values[key] = float(value)
    if dist == "constant" and values["std_s"] != 0:
        raise ValueError(f"{name}.std_s must be 0 for dist constant, got {values['std_s']}")
    if dist == "lognormal" and values["mean_s"] == 0 and values["std_s"] > 0:
        raise ValueError(f"{name}.mean_s must be > 0 for dist lognormal with std_s > 0")
    return Latency(dist=dist, mean_s=values["mean_s"], std_s=values["std_s"])


def sample_latency(spec: Optional[Latency], rng: random.Random) -> float:
    """One delay in seconds from a validated spec (0.0 for None)."""
    if spec is None:
        return 0.0
    mean_s, std_s = spec["mean_s"], spec["std_s"]
    if spec["dist"] == "constant" or std_s == 0:
        return mean_s
    if spec["dist"] == "normal":
        return max(0.0, rng.gauss(mean_s, std_s))
    mu, sigma = lognormal_params(mean_s, std_s)
    return rng.lognormvariate(mu, sigma)


def _check_prob(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")
    return float(value)


class LatencyEnv(Env):
    """Wraps an Env with random delays, failures (EnvError) and hangs; see the module doc."""

    def __init__(self, env: Env, *, step_latency: LatencySpec, reset_latency: LatencySpec = None,
                 failure_prob: float = 0.0, hang_prob: float = 0.0, seed: int = 0,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
        """``sleep`` is the coroutine that waits out a delay (tests pass a recorder)."""
        if not isinstance(env, Env):
            raise TypeError(f"LatencyEnv wraps an Env, got {type(env).__name__}")
        self.env = env
        self.step_latency = check_latency(step_latency, name="step_latency")
        self.reset_latency = check_latency(reset_latency, name="reset_latency")
        self.failure_prob = _check_prob("failure_prob", failure_prob)
        self.hang_prob = _check_prob("hang_prob", hang_prob)
        if self.failure_prob + self.hang_prob > 1.0:
            raise ValueError(f"failure_prob + hang_prob must be <= 1, got "
                             f"{self.failure_prob} + {self.hang_prob}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self._rng = random.Random(seed)
        self._sleep = sleep
        self.num_failures = 0
        self.num_hangs = 0

    def __repr__(self) -> str:
        return f"LatencyEnv({self.env!r})"

    @staticmethod
    def from_config(env: Env, cfg: Optional[Mapping[str, Any]], *,
                    seed: Optional[int] = None) -> Env:
        """The module-level ``from_config`` (wraps only when ``cfg`` is non-empty)."""
        return from_config(env, cfg, seed=seed)

    async def reset(self, seed: int) -> str:
        await self._inject("reset", self.reset_latency)
        return await self.env.reset(seed)

    async def step(self, action_text: str) -> StepResult:
        await self._inject("step", self.step_latency)
        return await self.env.step(action_text)

    async def close(self) -> None:
        await self.env.close()

    async def _inject(self, call: str, latency: Optional[Latency]) -> None:
        u = self._rng.random()
        delay = sample_latency(latency, self._rng)
        if self.failure_prob <= u < self.failure_prob + self.hang_prob:
            self.num_hangs += 1
            await asyncio.get_running_loop().create_future()  # until cancelled
        if delay > 0:
            await self._sleep(delay)
        if u < self.failure_prob:
            self.num_failures += 1
            raise EnvError(f"injected {call} failure in {self.env!r}")


_CONFIG_KEYS = ("step_latency", "reset_latency", "failure_prob", "hang_prob", "seed")
_instances = itertools.count()


def from_config(env: Env, cfg: Optional[Mapping[str, Any]], *, seed: Optional[int] = None) -> Env:
    """``env`` wrapped per an ``agentic.latency`` mapping (keys: step_latency, reset_latency,
    failure_prob, hang_prob, seed); an empty/None mapping returns ``env`` unchanged.

    ``seed`` given: the wrapper uses it (pass a distinct one per env instance). ``seed`` None: the
    mapping's seed (default 0) is combined with a per-process count of wrappers made here, so
    instances draw different delays (identical seeds would make all envs wait in lockstep) and a
    run that creates its envs in the same order draws the same delays again.
    """
    if not cfg:
        return env
    unknown = set(cfg) - set(_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"agentic.latency has unknown keys {sorted(unknown)}; "
                         f"known: {', '.join(_CONFIG_KEYS)}")
    kwargs = dict(cfg)
    base_seed = kwargs.pop("seed", 0)
    if isinstance(base_seed, bool) or not isinstance(base_seed, int):
        raise ValueError(f"agentic.latency.seed must be an int, got {base_seed!r}")
    kwargs["seed"] = seed if seed is not None else base_seed * 1_000_003 + next(_instances)
    kwargs.setdefault("step_latency", None)
    return LatencyEnv(env, **kwargs)

