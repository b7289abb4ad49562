"""The built-in synthetic tasks' names and settings (`data.task`, `data.task_args`, and the same in each
`eval.datasets.<name>`), checked when the config loads, before torch or the dataset exist: a wrong value
is one line naming its key, not a traceback after Megatron has started.

arith and sort4_long take settings; rewards/arith.py draws its questions from the `ArithSettings` made
here, and rewards/synthetic.py reads sort4_long's through `response_tokens`, so the load-time check and
the task cannot disagree.

    data.task_args        default     accepted
    digits                1           an integer in 1..6 (digits of each operand)
    operations            "+"         the operators to draw from, as typed: "+-*", "-", or a list ["+", "-"]
    word_problems         0.0         a fraction in [0, 1]
    non_negative          true        true | false (a − b draws a ≥ b)

On the command line `data.task_args.operations=-` is the text "-" (config/loader.py keeps a bare "-",
which YAML would read as a list holding one null, and operator text YAML cannot parse, such as "*", as
typed). In a YAML file quote it: `operations: "-"`.

    sort4_long            default     accepted
    response_tokens       2048        an integer >= 5 (the shortest rewarded response, answer included)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

BUILTIN_TASKS = ("add2", "arith", "countdown", "reverse4", "sort4", "sort4_long")
"""Every name data.task accepts (rewards/synthetic.py builds them; a unit test keeps the two equal)."""
TASKS_WITH_ARGS = ("arith", "sort4_long")
OPERATIONS = "+-*"


@dataclasses.dataclass(frozen=True)
class ArithSettings:
    digits: int = 1
    operations: str = "+"
    word_problems: float = 0.0
    non_negative: bool = True

    @classmethod
    def parse(cls, args: Mapping[str, Any] | None, *, key: str = "data.task_args") -> "ArithSettings":
        """The settings from `args` as a user wrote them; ValueError naming `key`.<setting> otherwise."""
        args = dict(args or {})
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(args) - set(known))
        if unknown:
            raise ValueError(f"{key}.{unknown[0]} is not an arith setting (known: {', '.join(sorted(known))})")
        if "operations" in args:
            args["operations"] = _operations(args["operations"], key=f"{key}.operations")
        spec = cls(**args)
        if isinstance(spec.digits, bool) or not isinstance(spec.digits, int) or not 1 <= spec.digits <= 6:
            raise ValueError(f"{key}.digits must be an integer in 1..6, got {spec.digits!r}")
        if (isinstance(spec.word_problems, bool) or not isinstance(spec.word_problems, (int, float))
                or not 0.0 <= spec.word_problems <= 1.0):
            raise ValueError(f"{key}.word_problems must be a fraction in [0, 1], got {spec.word_problems!r}")
        if not isinstance(spec.non_negative, bool):
            raise ValueError(f"{key}.non_negative must be true or false, got {spec.non_negative!r}")
        return spec


def _operations(value: Any, *, key: str) -> str:
    """ "+-", "-" or ["+", "-"] → "+-"; anything else is refused naming the key."""
    if isinstance(value, (list, tuple)):
        if any(v is None for v in value):
            raise ValueError(f"{key} got {list(value)!r}: in YAML a bare - is a list item; quote it (\"-\") "
                             f"or write a string of {OPERATIONS!r} such as \"+-\"")
        if not all(isinstance(v, str) for v in value):
            raise ValueError(f"{key} must be a string of {OPERATIONS!r} or a list of them, got {list(value)!r}")
        value = "".join(value)
    if not isinstance(value, str) or not value or set(value) - set(OPERATIONS):
        raise ValueError(f"{key} must be a non-empty string of {OPERATIONS!r} (or a list of them), got {value!r}")
    return value


def response_tokens(args: Mapping[str, Any] | None, *, key: str = "data.task_args") -> int:
    """sort4_long's one setting; ValueError naming `key`.<setting> otherwise."""
    args = dict(args or {})
    unknown = sorted(set(args) - {"response_tokens"})
    if unknown:
        raise ValueError(f"{key}.{unknown[0]} is not a sort4_long setting (known: response_tokens)")
    length = args.get("response_tokens", 2048)
    if isinstance(length, bool) or not isinstance(length, int) or length < 5:
        raise ValueError(f"{key}.response_tokens must be an integer >= 5 (4 digits and more), got {length!r}")
    return length


def check_task(task: str, args: Mapping[str, Any] | None, *, key: str) -> dict[str, Any]:
    """Validate a built-in task's name and settings (`key` = the task_args key, e.g. data.task_args);
    returns the settings given, normalised (operations as one string)."""
    task_key = key.rsplit(".", 1)[0] + ".task"
    if task not in BUILTIN_TASKS:
        raise ValueError(f"{task_key}={task!r} is not a built-in task (known: {', '.join(BUILTIN_TASKS)})")
    if task not in TASKS_WITH_ARGS:
        if args:
            raise ValueError(f"{key} is set, but {task_key}={task!r} takes no settings "
                             f"(only {' and '.join(TASKS_WITH_ARGS)} do)")
        return {}
    if args is not None and not isinstance(args, Mapping):
        raise ValueError(f"{key} must be a mapping of settings, got {args!r}")
    if task == "sort4_long":
        return {"response_tokens": response_tokens(args, key=key)} if args else {}
    spec = ArithSettings.parse(args, key=key)
    return {name: getattr(spec, name) for name in (args or {})}
