"""Synthetic verifiable tasks that a tiny model learns on CPU in minutes (see DESIGN.md).

  task       prompt      answer          notes
  ---------  ----------  --------------  ------------------------------------------------------------
  sort4      "3142:"     "1234"          4 distinct digits; chance after format warm-up ≈ 1/24
  reverse4   "3142:"     "2413"          sturdier, ~2× slower to learn
  countdown  "e:"        "edcba"         letter k → k down to 'a' (1–20 long, long tail): lengths
  add2       "12+47=?"   "59"            two 2-digit numbers; the calculator agent's questions (the
                                         agent calls a tool, then answers "answer: 59")
  arith      "What is 7 + 5?"  "12"      questions for real instruct models, free-text replies scored
                                         by the `math` reward; settings in data.task_args (rewards/arith.py)
  sort4_long "3142:"     "1234"          a long response: the answer first, and at least response_tokens
                                         characters in all (data.task_args, default 2048); scored by the
                                         `answer_first_long` reward (the warm-up continues in filler '|')

Each task gives a prompt/answer pair from a `random.Random`, a *format-only* answer for supervised
warm-up (right shape and length, wrong content: it teaches the format, not the task), and the
reward: 1.0 when the response is exactly the answer followed by the end token, else 0.0.
"""

from __future__ import annotations

import dataclasses
import random
import string
from typing import Callable

from megatron_flash.config.task_args import response_tokens

Pair = tuple[str, str]


@dataclasses.dataclass(frozen=True)
class SyntheticTask:
    name: str
    make: Callable[[random.Random], Pair]
    format_only: Callable[[random.Random, str], str]
    meta: dict = dataclasses.field(default_factory=dict)
    """Fields every row of the task carries (the reward reads them: sort4_long's response_tokens)."""


def _sort4(rng: random.Random) -> Pair:
    digits = rng.sample(string.digits, 4)
    return "".join(digits) + ":", "".join(sorted(digits))


def _reverse4(rng: random.Random) -> Pair:
    digits = rng.sample(string.digits, 4)
    return "".join(digits) + ":", "".join(reversed(digits))


def _permutation_of_input(rng: random.Random, prompt: str) -> str:
    body = list(prompt.rstrip(":"))
    rng.shuffle(body)
    return "".join(body)


def _countdown(rng: random.Random) -> Pair:
    # Long tail: lengths 1–20 with P(length k) ∝ 1/k.
    weights = [1.0 / k for k in range(1, 21)]
    k = rng.choices(range(1, 21), weights=weights)[0]
    letters = string.ascii_lowercase[:k]
    return letters[-1] + ":", letters[::-1]


def _countdown_format(rng: random.Random, prompt: str) -> str:
    k = string.ascii_lowercase.index(prompt[0]) + 1
    return "".join(rng.choice(string.ascii_lowercase[:20]) for _ in range(k))


def _add2(rng: random.Random) -> Pair:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a}+{b}=?", str(a + b)


def _random_number(rng: random.Random, prompt: str) -> str:
    return str(rng.randint(20, 198))


TASKS: dict[str, SyntheticTask] = {
    "sort4": SyntheticTask("sort4", _sort4, _permutation_of_input),
    "reverse4": SyntheticTask("reverse4", _reverse4, _permutation_of_input),
    "countdown": SyntheticTask("countdown", _countdown, _countdown_format),
    "add2": SyntheticTask("add2", _add2, _random_number),  # the calculator agent's questions ("12+47=?" -> "59")
}


LONG_FILLER = "|"
LONG_SLACK = 32
"""The format-only warm-up's responses are response_tokens + U[0, LONG_SLACK) characters long."""


def _sort4_long(args: dict | None, key: str) -> SyntheticTask:
    length = response_tokens(args, key=key)

    def format_only(rng: random.Random, prompt: str) -> str:
        answer = _permutation_of_input(rng, prompt)
        return answer + LONG_FILLER * max(0, length - len(answer) + rng.randrange(LONG_SLACK))
    return SyntheticTask("sort4_long", _sort4, format_only, meta={"response_tokens": length})


def get_task(name: str, args: dict | None = None, *, key: str = "data.task_args") -> SyntheticTask:
    """The task `name`; `args` (data.task_args) configure the ones that take settings (arith, sort4_long)."""
    if name == "arith":
        from megatron_flash.rewards.arith import ArithSpec

        spec = ArithSpec.from_args(args, key=key)
        return SyntheticTask("arith", spec.make, lambda rng, prompt: str(rng.randint(0, 99)))
    if name == "sort4_long":
        return _sort4_long(args, key)
    if name not in TASKS:
        known = ", ".join(sorted([*TASKS, "arith", "sort4_long"]))
        raise ValueError(f"unknown synthetic task {name!r}; known: {known}")
    if args:
        raise ValueError(f"{key} is set, but data.task={name!r} takes no settings (only arith and sort4_long do)")
    return TASKS[name]


def exact_match_reward(response_text: str, answer: str, *, finished: bool) -> float:
    """1.0 iff the model ended its response (end token) and the text before it is the answer."""
    return 1.0 if finished and response_text == answer else 0.0


def answer_first_long_reward(response_text: str, answer: str, *, response_tokens: int) -> float:
    """1.0 iff the response starts with the answer and is at least `response_tokens` characters long,
    finished or cut at max_new_tokens (what follows the answer is free)."""
    return 1.0 if response_text.startswith(answer) and len(response_text) >= response_tokens else 0.0
