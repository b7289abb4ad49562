"""The prompt source (`data`)."""

from __future__ import annotations

import os

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict

from megatron_flash.config.sections.base import _Section
from megatron_flash.config.task_args import TASKS_WITH_ARGS, check_task


@dataclass
class DataConfig(_Section):
    _section: ClassVar[str] = "data"

    path: str = ""
    """Prompt file (.jsonl, .json or .parquet), a dataset directory, or a Hub dataset id ("org/name",
    resolved through the Hugging Face cache like model.hf_path); takes precedence over task."""
    split: str = "train"
    """The split read from a dataset directory or Hub dataset; a single file is one split (train)."""
    prompt_key: str = "prompt"
    """Column/field holding the prompt text."""
    answer_key: str = "answer"
    """Column/field holding the reference answer the reward compares with."""
    task: str = ""
    """Built-in synthetic task (e.g. sort4) used when path is empty."""
    task_args: Dict[str, Any] = field(default_factory=dict)
    """Settings of the built-in task; only arith takes any (digits, operations, word_problems,
    non_negative: rewards/arith.py)."""
    num_samples: int = 0
    """Prompts to use from the dataset; 0 = all (synthetic tasks: their default size)."""
    shuffle: bool = True
    """Shuffle prompt order each epoch (seeded by trainer.seed)."""
    apply_chat_template: bool = False
    """Wrap each prompt as one user message in the tokenizer's chat template (with the generation
    prompt) before tokenizing; false = tokenize the raw prompt text."""
    max_prompt_len: int = 0
    """Longest prompt kept, in tokens (after the chat template); longer ones are skipped and
    counted. 0 = no limit."""

    def validate(self) -> None:
        self._require(bool(self.prompt_key), "prompt_key", "must be non-empty")
        self._require(bool(self.answer_key), "answer_key", "must be non-empty")
        self._at_least("num_samples", 0)
        self._at_least("max_prompt_len", 0)
        self._require(bool(self.split), "split", "must be non-empty")
        if self.split != "train" and os.path.splitext(self.path)[1].lower() in (".jsonl", ".json", ".parquet"):
            raise ValueError(f"data.split={self.split!r}: data.path={self.path!r} is a single file, which holds one "
                             "split (train); a split is chosen from a dataset directory or Hub dataset id")
        if self.task:
            self.task_args = check_task(self.task, self.task_args, key="data.task_args")
        elif self.task_args:
            raise ValueError(f"data.task_args is set, but data.task is empty (only the built-in task "
                             f"{', '.join(TASKS_WITH_ARGS)} takes settings)")
