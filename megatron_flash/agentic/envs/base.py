"""Shared machinery of the built-in text environments: episode bookkeeping, invalid actions, parsing.

Every built-in renders observations in the tiny character vocabulary ``ALPHABET`` (digits, lowercase
letters, ``:=+-,|?`` and space), so the CPU test model can read and write them.

Direction actions (frozenlake, sokoban). ``parse_direction`` lowercases the text, splits it into
runs of letters (any other character separates), and returns the first run that is one of
``l r u d left right up down``; "d", "move: down" and "i go d" all mean down, "dl" is not an
action (one run, not a direction word), and a text without such a run is invalid.
"""

from __future__ import annotations

import abc
import math
import operator
import random
import re
from typing import Any, ClassVar, Optional

from megatron_flash.agentic.protocol import EnvError, StepResult, SyncEnv

ALPHABET = frozenset("0123456789abcdefghijklmnopqrstuvwxyz:=+-,|? ")
"""Characters the CPU test tokenizer knows; built-in observations use only these by default."""

DIRECTIONS: dict[str, tuple[int, int]] = {"l": (0, -1), "r": (0, 1), "u": (-1, 0), "d": (1, 0)}
"""Action letter -> (row, column) offset; row 0 is the top row of the rendered map."""

_DIRECTION_WORDS = {"l": "l", "r": "r", "u": "u", "d": "d",
                    "left": "l", "right": "r", "up": "u", "down": "d"}
_LETTER_RUNS = re.compile(r"[a-z]+")


def parse_direction(action_text: str) -> Optional[str]:
    """The first direction word in the text as ``l``/``r``/``u``/``d``, or None (see module doc)."""
    for run in _LETTER_RUNS.findall(action_text.lower()):
        if run in _DIRECTION_WORDS:
            return _DIRECTION_WORDS[run]
    return None


def random_direction(rng: random.Random) -> str:
    return rng.choice("lrud")


class TextEnv(SyncEnv):
    """Episode bookkeeping shared by the built-ins.

    Subclasses implement ``_new_episode(seed)``, ``parse_action(text)`` (None = invalid),
    ``_apply(action) -> (reward, done, success, extra_info)`` and ``render()``. This class counts
    steps, handles invalid actions, truncates at ``max_steps`` and fills the standard info keys
    ``success``, ``invalid`` and ``truncated``.
    """

    env_name: ClassVar[str] = ""
    instructions: ClassVar[str] = ""

    def __init__(self, *, max_steps: int, invalid_penalty: float, end_on_invalid: bool,
                 show_instructions: bool) -> None:
        _check_int("max_steps", max_steps, minimum=1)
        _check_float("invalid_penalty", invalid_penalty)
        _check_bool("end_on_invalid", end_on_invalid)
        _check_bool("show_instructions", show_instructions)
        self.max_steps = max_steps
        self.invalid_penalty = float(invalid_penalty)
        self.end_on_invalid = end_on_invalid
        self.show_instructions = show_instructions
        self.num_steps = 0
        self.done = True  # no episode until reset()
        self.seed: Optional[int] = None

    # -- subclass hooks -------------------------------------------------------------------------

    @abc.abstractmethod
    def _new_episode(self, seed: int) -> None: ...

    @abc.abstractmethod
    def parse_action(self, action_text: str) -> Any:
        """The parsed action, or None when the text holds no valid action."""

    @abc.abstractmethod
    def _apply(self, action: Any) -> tuple[float, bool, bool, dict]:
        """Apply a parsed action: (reward, done, success, extra info)."""

    @abc.abstractmethod
    def render(self) -> str:
        """The current state as an observation."""

    @staticmethod
    @abc.abstractmethod
    def random_valid_action(rng: random.Random) -> str:
        """A syntactically valid action (not necessarily a good one), for format warm-up."""

    # -- SyncEnv --------------------------------------------------------------------------------

    def reset(self, seed: int) -> str:
        try:
            seed = operator.index(seed)
        except TypeError:
            raise ValueError(f"{self.env_name}: seed must be an int, got {seed!r}") from None
        self.seed, self.num_steps, self.done = seed, 0, False
        self._new_episode(seed)
        observation = self.render()
        return f"{self.instructions} {observation}" if self.show_instructions else observation

    def step(self, action_text: str) -> StepResult:
        if self.done:
            raise EnvError(f"{self.env_name}: step() without an episode in progress; call reset()")
        if not isinstance(action_text, str):
            raise TypeError(f"{self.env_name}: action_text must be a str, got {type(action_text).__name__}")
        self.num_steps += 1
        action = self.parse_action(action_text)
        if action is None:
            reward, done, success = self.invalid_penalty, self.end_on_invalid, False
            info: dict = {}
            observation = "invalid " + self.render()
        else:
            reward, done, success, info = self._apply(action)
            observation = self.render_after_step()
        truncated = not done and self.num_steps >= self.max_steps
        self.done = done or truncated
        info.update(success=success, invalid=action is None, truncated=truncated)
        return StepResult(observation=observation, reward=float(reward), done=self.done, info=info)

    def render_after_step(self) -> str:
        """The observation after a valid step (the state by default)."""
        return self.render()


# -- parameter checks: ValueError naming the parameter ------------------------------------------

def _check_int(name: str, value: Any, *, minimum: Optional[int] = None,
               maximum: Optional[int] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def _check_float(name: str, value: Any, *, minimum: Optional[float] = None,
                 maximum: Optional[float] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
