"""Built-in tasks' settings (`data.task_args`, `eval.datasets.<name>.task_args`) are checked when the
config loads: one error naming the key, before torch (the launcher: one line, exit 2). One case per task,
and the ways users type arith's operators."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_flash.config import ConfigError, load_config  # noqa: E402
from megatron_flash.config.task_args import BUILTIN_TASKS  # noqa: E402
from tests.unit.test_config import _heavy, _imported, _launch, _messages  # noqa: E402


def test_the_task_list_is_the_one_the_rewards_build() -> None:
    from megatron_flash.rewards.synthetic import TASKS, get_task

    assert set(BUILTIN_TASKS) == set(TASKS) | {"arith", "sort4_long"}
    for name in BUILTIN_TASKS:
        assert get_task(name).name == name


@pytest.mark.parametrize("task", ["sort4", "reverse4", "countdown", "add2"])
def test_a_task_without_settings_refuses_any(task: str) -> None:
    assert load_config(None, [f"data.task={task}"]).data.task_args == {}
    with pytest.raises(ConfigError, match=rf"^data.task_args is set, but data.task='{task}' takes no settings"):
        load_config(None, [f"data.task={task}", "data.task_args={digits: 2}"])
    with pytest.raises(ConfigError, match=rf"^eval.datasets.held.task_args is set, but eval.datasets.held.task="
                                          rf"'{task}' takes no settings"):
        load_config(None, ["data.task=sort4", f"eval.datasets={{held: {{task: {task}, task_args: {{x: 1}}}}}}"])


def test_an_unknown_task_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match=r"^data.task='sort5' is not a built-in task \(known: add2, arith, "):
        load_config(None, ["data.task=sort5"])
    with pytest.raises(ConfigError, match=r"^eval.datasets.held.task='nope' is not a built-in task"):
        load_config(None, ["data.task=sort4", "eval.datasets={held: {task: nope}}"])


@pytest.mark.parametrize("override, message", [
    ("data.task_args.digit=2", "data.task_args.digit is not an arith setting (known: digits, non_negative, "),
    ("data.task_args.digits=0", "data.task_args.digits must be an integer in 1..6, got 0"),
    ("data.task_args.digits=7", "data.task_args.digits must be an integer in 1..6, got 7"),
    ("data.task_args.digits=true", "data.task_args.digits must be an integer in 1..6, got True"),
    ("data.task_args.operations=/", "data.task_args.operations must be a non-empty string of '+-*'"),
    ("data.task_args.operations=+x", "data.task_args.operations must be a non-empty string of '+-*'"),
    ("data.task_args.operations=[+, 2]", "data.task_args.operations must be a string of '+-*' or a list"),
    ("data.task_args.word_problems=1.5", "data.task_args.word_problems must be a fraction in [0, 1], got 1.5"),
    ("data.task_args.non_negative=maybe", "data.task_args.non_negative must be true or false, got 'maybe'"),
])
def test_a_bad_arith_setting_is_refused_at_load_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["data.task=arith", override])
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("typed, operations", [
    ("-", "-"), ("*", "*"), ("+-", "+-"), ("-+", "-+"), ("*+", "*+"), ("+-*", "+-*"),
    ('["+", "-"]', "+-"), ("['*']", "*"),
])
def test_operations_take_what_users_type(typed: str, operations: str) -> None:
    cfg = load_config(None, ["data.task=arith", f"data.task_args.operations={typed}"])
    assert cfg.data.task_args == {"operations": operations}


def test_operations_as_a_bare_dash_in_a_yaml_file_says_to_quote_it(tmp_path: Path) -> None:
    path = tmp_path / "arith.yaml"
    path.write_text("data:\n  task: arith\n  task_args:\n    operations:\n      -\n")  # a list holding null
    with pytest.raises(ConfigError, match=r"^data.task_args.operations got \[None\]: in YAML a bare - is a list "
                                          r"item; quote it"):
        load_config(path)
    path.write_text('data:\n  task: arith\n  task_args:\n    operations: "-"\n')
    assert load_config(path).data.task_args == {"operations": "-"}


def test_a_bad_eval_setting_names_the_evaluation_set() -> None:
    with pytest.raises(ConfigError, match=r"^eval.datasets.add2d.task_args.digits must be an integer in 1..6, got 9"):
        load_config(None, ["data.task=arith", "eval.datasets={add2d: {task: arith, task_args: {digits: 9}}}"])
    cfg = load_config(None, ["data.task=arith", "eval.datasets={sub: {task: arith, task_args: {operations: ['-', '+']}}}"])
    assert cfg.eval.datasets["sub"]["task_args"] == {"operations": "-+"}


def test_the_dataset_draws_from_the_normalised_operations() -> None:
    import random

    from megatron_flash.rewards.synthetic import get_task

    cfg = load_config(None, ["data.task=arith", "data.task_args.operations=-"])
    task, rng = get_task("arith", cfg.data.task_args), random.Random(0)
    pairs = [task.make(rng) for _ in range(20)]
    for question, answer in pairs:  # "What is a - b?", a ≥ b
        a, b = (int(x) for x in question.removeprefix("What is ").removesuffix("?").split(" - "))
        assert int(answer) == a - b >= 0, (question, answer)


def test_the_launcher_refuses_a_bad_task_setting_in_one_line_before_torch() -> None:
    proc = _launch("--config", "configs/quickstart_cpu.yaml", "data.task=arith", "data.task_args.digits=9")
    messages = _messages(proc.stderr).strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(messages) == 1 and "data.task_args.digits must be an integer in 1..6, got 9" in messages[0], messages
    assert not _heavy(_imported(proc.stderr)), _heavy(_imported(proc.stderr))
