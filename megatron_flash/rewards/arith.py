"""The built-in arithmetic task (`data.task=arith`): questions an instruct model answers in free text,
scored by the `math` reward (math-verify on the reply: a boxed answer, else the last number).

    data.task_args        default     what
    digits                1           digits of each operand (1: 0–9, 2: 10–99, ...)
    operations            "+"         any of + - * ("+-", or a list); each question draws one
    word_problems         0.0         fraction of questions asked as a short story instead of "What is a + b?"
    non_negative          true        a − b draws a ≥ b (no negative answers)
(The settings are checked when the config loads: config/task_args.py.)

Examples (seeded): "What is 7 + 5?" → "12"; "Tom has 23 apples. He buys 48 more. How many apples does
Tom have now?" → "71". The prompt is the question alone; `data.apply_chat_template=true` puts it in the
model's chat template. Training and each evaluation set draw from different seeds (rollout/dataset.py,
rollout/evaluation.py), so held-out questions are other questions.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from megatron_flash.config.task_args import ArithSettings

_NAMES = ("Tom", "Ana", "Li", "Sara", "Omar", "Mia", "Ravi", "Zoe")
_THINGS = ("apples", "pencils", "stickers", "coins", "books", "marbles")
_WORDS = {
    "+": "{name} has {a} {thing}. Then {name} gets {b} more. How many {thing} does {name} have now?",
    "-": "{name} has {a} {thing}. Then {name} gives away {b}. How many {thing} does {name} have left?",
    "*": "{name} has {a} boxes with {b} {thing} in each box. How many {thing} does {name} have in all?",
}


@dataclasses.dataclass(frozen=True)
class ArithSpec:
    settings: ArithSettings

    @classmethod
    def from_args(cls, args: dict[str, Any] | None, *, key: str = "data.task_args") -> "ArithSpec":
        """The task from data.task_args (checked at config load already; again here for direct callers)."""
        return cls(ArithSettings.parse(args, key=key))

    def make(self, rng: random.Random) -> tuple[str, str]:
        s = self.settings
        low, high = (0 if s.digits == 1 else 10 ** (s.digits - 1)), 10 ** s.digits - 1
        a, b = rng.randint(low, high), rng.randint(low, high)
        op = rng.choice(s.operations)
        if op == "-" and s.non_negative and a < b:
            a, b = b, a
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        if rng.random() < s.word_problems:
            name = rng.choice(_NAMES)
            text = _WORDS[op].format(name=name, a=a, b=b, thing=rng.choice(_THINGS))
        else:
            text = f"What is {a} {op} {b}?"
        return text, str(answer)
