"""The built-in arithmetic task (`data.task=arith`): questions an instruct model answers in free text,
scored by the `math` reward (math-verify on the reply: a boxed answer, else the last number).

    data.task_args        default     what
    digits                1           digits of each operand (1: 0–9, 2: 10–99, ...)
    operations            "+"         any of + - * ; each question draws one
    word_problems         0.0         fraction of questions asked as a short story instead of "What is a + b?"
    non_negative          true        a − b draws a ≥ b (no negative answers)

Examples (seeded): "What is 7 + 5?" → "12"; "Tom has 23 apples. He buys 48 more. How many apples does
Tom have now?" → "71". The prompt is the question alone; `data.apply_chat_template=true` puts it in the
model's chat template. Training and each evaluation set draw from different seeds (rollout/dataset.py,
rollout/evaluation.py), so held-out questions are other questions.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

OPERATIONS = "+-*"
_NAMES = ("Tom", "Ana", "Li", "Sara", "Omar", "Mia", "Ravi", "Zoe")
_THINGS = ("apples", "pencils", "stickers", "coins", "books", "marbles")
_WORDS = {
    "+": "{name} has {a} {thing}. Then {name} gets {b} more. How many {thing} does {name} have now?",
    "-": "{name} has {a} {thing}. Then {name} gives away {b}. How many {thing} does {name} have left?",
    "*": "{name} has {a} boxes with {b} {thing} in each box. How many {thing} does {name} have in all?",
}


@dataclasses.dataclass(frozen=True)
class ArithSpec:
    digits: int = 1
    operations: str = "+"
    word_problems: float = 0.0
    non_negative: bool = True

    @classmethod
    def from_args(cls, args: dict[str, Any] | None, *, key: str = "data.task_args") -> "ArithSpec":
        args = dict(args or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"{key}.{unknown[0]} is not an arith setting (known: {', '.join(sorted(known))})")
        spec = cls(**args)
        if not isinstance(spec.digits, int) or not 1 <= spec.digits <= 6:
            raise ValueError(f"{key}.digits must be an integer in 1..6, got {spec.digits!r}")
        if not isinstance(spec.operations, str) or not spec.operations or set(spec.operations) - set(OPERATIONS):
            raise ValueError(f"{key}.operations must be a non-empty string of {OPERATIONS!r}, got {spec.operations!r}")
        if not isinstance(spec.word_problems, (int, float)) or not 0.0 <= spec.word_problems <= 1.0:
            raise ValueError(f"{key}.word_problems must be a fraction in [0, 1], got {spec.word_problems!r}")
        if not isinstance(spec.non_negative, bool):
            raise ValueError(f"{key}.non_negative must be true or false, got {spec.non_negative!r}")
        return spec

    def make(self, rng: random.Random) -> tuple[str, str]:
        low, high = (0 if self.digits == 1 else 10 ** (self.digits - 1)), 10 ** self.digits - 1
        a, b = rng.randint(low, high), rng.randint(low, high)
        op = rng.choice(self.operations)
        if op == "-" and self.non_negative and a < b:
            a, b = b, a
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        if rng.random() < self.word_problems:
            name = rng.choice(_NAMES)
            text = _WORDS[op].format(name=name, a=a, b=b, thing=rng.choice(_THINGS))
        else:
            text = f"What is {a} {op} {b}?"
        return text, str(answer)
