"""Calculator: answer an integer arithmetic question, optionally calling a calculator tool first.

Task. From the seed: ``difficulty`` + 1 integer operands in 0..``max_operand`` joined by
``difficulty`` operators drawn from ``+ - x`` (``x`` is multiplication; set ``mul_symbol="*"`` for
``*``). The answer follows the usual precedence (multiplication first, then left to right). With
``parentheses=true`` (difficulty >= 2) a random inner run of operands is bracketed; ``(`` ``)`` and
``*`` are outside the tiny test vocabulary, so both are off by default.

Observation. ``question: 37+45x2 =?``; the first one starts with the instructions (unless
``show_instructions=false``)::

    calculator: use calc:expression or answer:number question: 37+45x2 =?

after a tool call ``result:127`` or ``error:<reason>``; after an answer ``correct`` or ``incorrect``.

Action. The reply is lowercased; the earliest ``calc:`` or ``answer:`` in it decides:

  calc:<expr>    <expr> is the longest run of ``0-9 + - * x ( )`` and spaces right after the colon.
                 Valid expressions (integers, binary + - * x, unary minus, parentheses; at most
                 ``MAX_EXPR_CHARS`` characters) give ``result:<value>``; others give
                 ``error:<reason>`` and ``info["tool_error"] = reason``, reward 0, episode goes on.
  answer:<int>   optional spaces, optional sign, digits. Ends the episode: reward 1.0 and
                 ``info["success"]`` if it equals the true value, else 0.0.

Anything else (including ``answer:`` without digits) is invalid: ``invalid_penalty``, observation
``invalid question: ...``, done only with ``end_on_invalid``. Every step counts towards
``max_steps``; reaching it without an answer ends the episode with reward 0 and
``info["truncated"]``. Expressions are evaluated by the small parser below, never by ``eval``.
"""

from __future__ import annotations

import random
import re
from typing import Optional, Union

from megatron_flash.agentic.envs.base import TextEnv, _check_bool, _check_int
from megatron_flash.agentic.registry import register_env

MAX_EXPR_CHARS = 100
"""Longer tool arguments are rejected (keeps parse time and number sizes trivially bounded)."""
MAX_ANSWER_DIGITS = 60

_CALC_ARG = re.compile(r"[0-9+\-*x() ]*")
_ANSWER_ARG = re.compile(r" *([+-]?[0-9]+)")
_TOKEN = re.compile(r"\s*(?:(\d+)|(.))", re.S)


class CalcError(ValueError):
    """A tool argument the calculator rejects; the message is the observation's reason."""


def evaluate(expr: str) -> int:
    """Value of an integer expression with + - * (or x), unary minus and parentheses.

    Grammar (recursive descent, left-associative)::

        expr   := term (('+' | '-') term)*
        term   := factor (('*' | 'x') factor)*
        factor := ('-' | '+') factor | integer | '(' expr ')'
    """
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcError("too long")
    tokens: list[str] = []
    for number, other in _TOKEN.findall(expr):
        if number:
            tokens.append(number)
        elif other.strip():
            if other not in "+-*x()":
                raise CalcError("bad character")
            tokens.append("*" if other == "x" else other)
    if not tokens:
        raise CalcError("empty expression")
    parser = _Parser(tokens)
    value = parser.expr(depth=0)
    if parser.pos != len(tokens):
        raise CalcError("unbalanced parentheses" if tokens[parser.pos] == ")" else "bad expression")
    return value


class _Parser:
    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.pos = 0

    def _peek(self) -> Optional[str]:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def expr(self, depth: int) -> int:
        value = self.term(depth)
        while self._peek() in ("+", "-"):
            op = self.tokens[self.pos]
            self.pos += 1
            rhs = self.term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self, depth: int) -> int:
        value = self.factor(depth)
        while self._peek() == "*":
            self.pos += 1
            value *= self.factor(depth)
        return value

    def factor(self, depth: int) -> int:
        if depth > 2 * MAX_EXPR_CHARS:  # unreachable within the length limit; a backstop only
            raise CalcError("too deep")
        token = self._peek()
        if token is None:
            raise CalcError("bad expression")
        self.pos += 1
        if token in ("-", "+"):
            value = self.factor(depth + 1)
            return -value if token == "-" else value
        if token == "(":
            value = self.expr(depth + 1)
            if self._peek() != ")":
                raise CalcError("unbalanced parentheses")
            self.pos += 1
            return value
        if token.isdigit():
            return int(token)
        raise CalcError("unbalanced parentheses" if token == ")" else "bad expression")


def parse_calculator_action(action_text: str) -> Optional[tuple[str, Union[str, int]]]:
    """("calc", expression) or ("answer", value) by the rule in the module doc, or None."""
    text = action_text.lower()
    calc_at, answer_at = text.find("calc:"), text.find("answer:")
    if calc_at >= 0 and (answer_at < 0 or calc_at < answer_at):
        rest = text[calc_at + len("calc:"):]
        return "calc", _CALC_ARG.match(rest).group(0).strip()
    if answer_at >= 0:
        match = _ANSWER_ARG.match(text, answer_at + len("answer:"))
        if match and len(match.group(1).lstrip("+-")) <= MAX_ANSWER_DIGITS:
            return "answer", int(match.group(1))
    return None


def generate_question(rng: random.Random, *, difficulty: int, max_operand: int, mul_symbol: str,
                      parentheses: bool) -> str:
    operands = [str(rng.randint(0, max_operand)) for _ in range(difficulty + 1)]
    operators = [rng.choice(("+", "-", mul_symbol)) for _ in range(difficulty)]
    if parentheses and difficulty >= 2:
        first = rng.randrange(0, difficulty)  # bracket operands first..last, never all of them
        last = rng.randrange(first + 1, difficulty + 1 if first > 0 else difficulty)
        operands[first] = "(" + operands[first]
        operands[last] = operands[last] + ")"
    parts = [operands[0]]
    for op, operand in zip(operators, operands[1:]):
        parts += [op, operand]
    return "".join(parts)


@register_env("calculator")
class CalculatorEnv(TextEnv):
    env_name = "calculator"
    instructions = "calculator: use calc:expression or answer:number"

    def __init__(self, *, difficulty: int = 2, max_operand: int = 99, mul_symbol: str = "x",
                 parentheses: bool = False, max_steps: int = 4, invalid_penalty: float = 0.0,
                 end_on_invalid: bool = False, show_instructions: bool = True) -> None:
        """
        difficulty: number of operators in the question (1..8).
        max_operand: largest operand (operands are 0..max_operand).
        mul_symbol: "x" (default, in the tiny vocabulary) or "*".
        parentheses: bracket a random inner run of operands (difficulty >= 2).
        max_steps: steps (tool calls + the answer) per episode.
        invalid_penalty, end_on_invalid: reward of / episode end on an unparseable reply.
        show_instructions: start the first observation with the instructions.
        """
        _check_int("difficulty", difficulty, minimum=1, maximum=8)
        _check_int("max_operand", max_operand, minimum=1, maximum=10**6)
        if mul_symbol not in ("x", "*"):
            raise ValueError(f"mul_symbol must be 'x' or '*', got {mul_symbol!r}")
        _check_bool("parentheses", parentheses)
        super().__init__(max_steps=max_steps, invalid_penalty=invalid_penalty,
                         end_on_invalid=end_on_invalid, show_instructions=show_instructions)
        self.difficulty = difficulty
        self.max_operand = max_operand
        self.mul_symbol = mul_symbol
        self.parentheses = parentheses
        self.question = ""
        self.answer = 0
        self._last = ""  # observation after the last valid step

    def __repr__(self) -> str:
        return f"CalculatorEnv(difficulty={self.difficulty}, seed={self.seed})"

    def _new_episode(self, seed: int) -> None:
        self.question = generate_question(random.Random(seed), difficulty=self.difficulty,
                                          max_operand=self.max_operand,
                                          mul_symbol=self.mul_symbol, parentheses=self.parentheses)
        self.answer = evaluate(self.question)

    def parse_action(self, action_text: str) -> Optional[tuple[str, Union[str, int]]]:
        return parse_calculator_action(action_text)

    def _apply(self, action: tuple[str, Union[str, int]]) -> tuple[float, bool, bool, dict]:
        kind, argument = action
        if kind == "answer":
            correct = argument == self.answer
            self._last = "correct" if correct else "incorrect"
            return (1.0 if correct else 0.0), True, correct, {}
        try:
            self._last = f"result:{evaluate(argument)}"
            return 0.0, False, False, {"tool_call": True}
        except CalcError as e:
            self._last = f"error:{e}"
            return 0.0, False, False, {"tool_call": True, "tool_error": str(e)}

    def render(self) -> str:
        return f"question: {self.question} =?"

    def render_after_step(self) -> str:
        return self._last

    @staticmethod
    def random_valid_action(rng: random.Random) -> str:
        if rng.random() < 0.5:
            return f"answer:{rng.randint(-99, 999)}"
        num_ops = rng.randint(1, 3)
        parts = [str(rng.randint(0, 99))]
        for _ in range(num_ops):
            parts += [rng.choice("+-x"), str(rng.randint(0, 99))]
        return "calc:" + "".join(parts)
