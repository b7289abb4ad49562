"""Periodic evaluation on held-out sets (`eval`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Dict

from megatron_flash.config.sections.base import _Section
from megatron_flash.config.sections.data import DataConfig
from megatron_flash.config.task_args import check_task


@dataclass
class EvalConfig(_Section):
    _section: ClassVar[str] = "eval"

    datasets: Dict[str, Any] = field(default_factory=dict)
    """Held-out sets by name, each a mapping of `data` fields (path, prompt_key, answer_key, task,
    num_samples, apply_chat_template, max_prompt_len); empty = no evaluation. Synthetic tasks are
    drawn with another seed than training's."""
    every_steps: int = 0
    """Evaluate after every this many steps; always at step 0 (before training) and after the last."""
    n_samples: int = 4
    """Responses per prompt: mean@n and the unbiased pass@k for k = 1, 2, 4, …, n."""
    max_new_tokens: int = 0
    """Longest evaluation response; 0 = rollout.max_new_tokens."""
    temperature: float = 1.0
    """Sampling temperature of evaluation requests."""
    correct_threshold: float = 1.0
    """A response counts as correct (pass@k) when its reward is at least this."""

    def validate(self) -> None:
        if not isinstance(self.datasets, dict):
            raise ValueError(f"eval.datasets must be a mapping of name → data fields, got {type(self.datasets).__name__}")
        allowed = ("path", "prompt_key", "answer_key", "task", "task_args", "num_samples", "apply_chat_template",
                   "max_prompt_len")
        for name, spec in self.datasets.items():
            if not isinstance(spec, dict):
                raise ValueError(f"eval.datasets.{name} must be a mapping of data fields ({', '.join(allowed)})")
            unknown = sorted(set(spec) - set(allowed))
            if unknown:
                raise ValueError(f"eval.datasets.{name}.{unknown[0]} is not a data field ({', '.join(allowed)})")
            if not spec.get("path") and not spec.get("task"):
                raise ValueError(f"eval.datasets.{name} needs a path or a task")
            if spec.get("task"):  # named here by its own key, not as data.task_args
                spec["task_args"] = check_task(spec["task"], spec.get("task_args") or {},
                                               key=f"eval.datasets.{name}.task_args")
            elif spec.get("task_args"):
                raise ValueError(f"eval.datasets.{name}.task_args is set, but eval.datasets.{name}.task is empty")
            try:
                DataConfig(**spec).validate()
            except ValueError as error:  # name the evaluation set, not the training data
                raise ValueError(f"eval.datasets.{name}: {error}") from None
        self._at_least("every_steps", 0)
        self._at_least("n_samples", 1)
        self._at_least("max_new_tokens", 0)
        self._positive("temperature")
        if not self.datasets:
            changed = [f.name for f in fields(self) if f.name != "datasets" and getattr(self, f.name) != f.default]
            if changed:
                raise ValueError(f"eval.{changed[0]} is set but eval.datasets is empty (nothing to evaluate)")
