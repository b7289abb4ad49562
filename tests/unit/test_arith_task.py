"""data.task=arith: every question's answer checked by reading the question back (numbers and operation
parsed from the text, the result computed here), its settings validated by name, training and
evaluation drawn from different seeds, and the `math` reward reading free-text replies the way an
instruct model writes them (last number, or a boxed answer)."""

from __future__ import annotations

import random
import re

import pytest

from megatron_flash.config import load_config
from megatron_flash.rewards.registry import math_reward
from megatron_flash.rewards.synthetic import get_task
from megatron_flash.rollout.dataset import _make_synthetic

WORD_OPS = {"gets": "+", "gives away": "-", "boxes with": "*"}


def solve(question: str) -> int:
    a, b = (int(x) for x in re.findall(r"\d+", question)[:2])
    m = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", question)
    op = m.group(2) if m else next(o for phrase, o in WORD_OPS.items() if phrase in question)
    return a + b if op == "+" else a - b if op == "-" else a * b


@pytest.mark.parametrize("args", [{}, {"digits": 2, "operations": "+-*", "word_problems": 0.5},
                                  {"digits": 3, "operations": "-", "non_negative": False}])
def test_answers_are_what_the_questions_ask(args: dict) -> None:
    task, rng = get_task("arith", args), random.Random(0)
    digits = args.get("digits", 1)
    seen_words = 0
    for _ in range(300):
        question, answer = task.make(rng)
        assert int(answer) == solve(question), question
        numbers = [int(x) for x in re.findall(r"\d+", question)[:2]]
        assert all(len(str(n)) == digits for n in numbers) or digits == 1 and all(n < 10 for n in numbers)
        seen_words += not question.startswith("What is")
        if args.get("non_negative", True):
            assert int(answer) >= 0
    if args.get("word_problems"):
        assert 100 < seen_words < 200  # about half of 300
    else:
        assert seen_words == 0


def test_default_questions_are_one_digit_additions() -> None:
    rows = _make_synthetic("arith", num_samples=50, seed=1)
    assert all(re.fullmatch(r"What is \d \+ \d\?", t) for t in rows.texts)


def test_training_and_evaluation_draw_other_questions() -> None:
    train = _make_synthetic("arith", num_samples=64, seed=0, args={"digits": 2})
    held_out = _make_synthetic("arith", num_samples=64, seed=1000, args={"digits": 2})
    assert len(set(train.texts) & set(held_out.texts)) < 8


@pytest.mark.parametrize("args, message", [
    ({"digit": 2}, "data.task_args.digit is not an arith setting"),
    ({"digits": 0}, "data.task_args.digits must be an integer in 1..6"),
    ({"operations": "/"}, "data.task_args.operations must be a non-empty string"),
    ({"word_problems": 1.5}, "data.task_args.word_problems must be a fraction"),
])
def test_bad_settings_are_named(args: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        get_task("arith", args)


def test_settings_for_a_task_without_any_are_refused_by_the_config() -> None:
    with pytest.raises(ValueError, match=r"data.task_args is set, but data.task='sort4' takes no settings"):
        load_config(None, ["data.task=sort4", "data.task_args={digits: 2}"])
    config = load_config(None, ["data.task=arith", "data.task_args={digits: 2, operations: '+-'}"])
    assert config.data.task_args == {"digits": 2, "operations": "+-"}


@pytest.mark.parametrize("reply, answer, reward", [
    ("3 + 4 = 7\n\nThis is a classic example of addition.", "7", 1.0),
    ("Tom has 23 apples and gets 48 more, so he has 23 + 48 = 71 apples.", "71", 1.0),
    ("So the answer is \\boxed{71}.", "71", 1.0),
    ("It is 70 or so, 3 more than 67.", "70", 0.0),  # the last number is the answer read
    ("Tom has 23 apples. He buys 48 more.", "71", 0.0),  # restating the problem is not answering it
])
def test_math_reward_reads_free_text_replies(reply: str, answer: str, reward: float) -> None:
    assert math_reward(reply, answer, finished=True) == reward
    assert math_reward(reply, answer, finished=False) == 0.0
