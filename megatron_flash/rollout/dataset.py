"""Prompt source for the rollout side: a file of prompts or a synthetic task, tokenized once at load.

    ds = PromptDataset.from_config(cfg.data, tokenizer, seed=cfg.trainer.seed)
    prompt = ds.next_prompt()          # Prompt(index, text, prompt_ids, answer, meta); never ends
    state = ds.state_dict()            # {"epoch": e, "position": p}: saved with the checkpoint
    PromptDataset.from_config(...).load_state_dict(state)   # continues with the very same prompts

Sources (``megatron_flash.config.schema.DataConfig``):

  data.path   .jsonl / .json / .parquet, or a dataset directory (a Hub dataset's snapshot, data.split),
              read with HF ``datasets``; ``data.prompt_key`` and
              ``data.answer_key`` name the columns, every other column lands in ``Prompt.meta``.
  data.task   a synthetic task from ``megatron_flash.rewards.synthetic`` (used when path is empty);
              ``data.num_samples`` items (1024 when 0) drawn from ``random.Random(seed)``.

Every row is checked when the file is loaded (a missing field, a null or empty prompt), so a bad
row stops the run at start with its 1-based row number instead of hours later. Order: epoch e visits
all items once, shuffled by a generator seeded with (seed, e) when ``data.shuffle``; the order of an
epoch is a pure function of (seed, e), which is what makes ``state_dict`` two integers.
"""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Any, Mapping, Sequence

from megatron_flash.config.schema import DataConfig
from megatron_flash.rewards.synthetic import get_task

DEFAULT_SYNTHETIC_SAMPLES = 1024
_LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclasses.dataclass
class Prompt:
    index: int
    """0-based row of the source file (or item of the synthetic task)."""
    text: str
    """The prompt as in the source, before any chat template."""
    prompt_ids: list[int]
    """Token ids sent to the engine (chat template applied when data.apply_chat_template)."""
    answer: str
    """Reference answer for the reward, as a string."""
    meta: dict[str, Any]
    """The row's other fields (synthetic tasks: {"task": name})."""


@dataclasses.dataclass
class _Rows:
    """Validated source rows, column-wise: texts[i], answers[i], metas[i] belong to row indices[i]."""

    indices: list[int]
    texts: list[str]
    answers: list[str]
    metas: list[dict[str, Any]]


class PromptDataset:
    """An endless, resumable stream of tokenized prompts (see the module docstring)."""

    def __init__(self, prompts: Sequence[Prompt], *, seed: int, shuffle: bool, num_skipped: int = 0) -> None:
        if not prompts:
            raise ValueError("the prompt dataset is empty (after data.num_samples and data.max_prompt_len)")
        self._prompts = list(prompts)
        self._seed = seed
        self._shuffle = shuffle
        self.num_skipped = num_skipped
        """Prompts dropped at load because they were longer than data.max_prompt_len."""
        self._epoch = 0
        self._position = 0
        self._order = self._epoch_order(0)

    @classmethod
    def from_config(cls, data_cfg: DataConfig, tokenizer: Any, *, seed: int) -> "PromptDataset":
        """Load, validate and tokenize the prompts named by ``data_cfg``.

        Raises:
            FileNotFoundError: data.path does not exist.
            ValueError: neither data.path nor data.task is set, an unsupported file type, or a bad
                row (its 1-based number, the missing field and the config key that names it).
        """
        if data_cfg.path:
            rows = _load_file(data_cfg)
        elif data_cfg.task:
            rows = _make_synthetic(data_cfg.task, num_samples=data_cfg.num_samples, seed=seed,
                                   args=data_cfg.task_args)
        else:
            raise ValueError("no prompts configured: set data.path (a .jsonl/.json/.parquet file) "
                             "or data.task (a synthetic task such as sort4)")
        ids = _tokenize(rows.texts, tokenizer, chat_template=data_cfg.apply_chat_template)
        prompts, num_skipped = [], 0
        for i, prompt_ids in enumerate(ids):
            if data_cfg.max_prompt_len and len(prompt_ids) > data_cfg.max_prompt_len:
                num_skipped += 1
                continue
            prompts.append(Prompt(index=rows.indices[i], text=rows.texts[i], prompt_ids=prompt_ids,
                                  answer=rows.answers[i], meta=rows.metas[i]))
        return cls(prompts, seed=seed, shuffle=data_cfg.shuffle, num_skipped=num_skipped)

    @property
    def prompts(self) -> list[Prompt]:
        """Every prompt, in source order (what an evaluation set visits)."""
        return list(self._prompts)

    def drop_longer_than(self, max_len: int, *, why: str) -> int:
        """Drop prompts of more than `max_len` tokens (before any is drawn: the epoch order is made
        again); returns how many. Raises ValueError, naming the longest prompt, when none is left."""
        keep = [p for p in self._prompts if len(p.prompt_ids) <= max_len]
        if not keep:
            longest = max(self._prompts, key=lambda p: len(p.prompt_ids))
            raise ValueError(f"no prompt fits {why}: every one is longer than {max_len} tokens (e.g. row "
                             f"{longest.index + 1}: {len(longest.prompt_ids)} tokens)")
        dropped = len(self._prompts) - len(keep)
        self._prompts = keep
        self.num_skipped += dropped
        self._order = self._epoch_order(self._epoch)
        return dropped

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def epoch(self) -> int:
        """Passes completed over the data, i.e. the epoch the next prompt comes from."""
        return self._epoch

    def next_prompt(self) -> Prompt:
        """The next prompt; after the last one of an epoch the next epoch starts (reshuffled)."""
        prompt = self._prompts[self._order[self._position]]
        self._position += 1
        if self._position == len(self._prompts):
            self._epoch, self._position = self._epoch + 1, 0
            self._order = self._epoch_order(self._epoch)
        return prompt

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from ``state`` (from ``state_dict`` of a dataset built from the same config and seed)."""
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self._prompts):
            raise ValueError(f"dataset state {dict(state)} does not fit a dataset of {len(self)} prompts "
                             "(was it saved with another data config?)")
        self._epoch, self._position = epoch, position
        self._order = self._epoch_order(epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._prompts)))
        if self._shuffle:
            # A string seed is hashed with SHA-512: the same order in every process and Python run.
            random.Random(f"megatron-flash/data/{self._seed}/{epoch}").shuffle(order)
        return order


def _load_file(cfg: DataConfig) -> _Rows:
    path = cfg.path
    if not os.path.exists(path):
        raise FileNotFoundError(f"data.path: prompt file {path!r} does not exist")
    ext = os.path.splitext(path)[1].lower()
    if os.path.isfile(path) and ext not in _LOADERS:
        raise ValueError(f"data.path: unsupported file type {ext or '(none)'!r} for {path!r}; "
                         f"use one of {', '.join(sorted(_LOADERS))}, or a dataset directory")
    import datasets  # heavy; only when a file is used

    try:
        if os.path.isdir(path):  # a dataset's files (e.g. a Hub snapshot): datasets finds its splits
            table = datasets.load_dataset(path, split=cfg.split)
        else:
            table = datasets.load_dataset(_LOADERS[ext], data_files=path, split="train")
    except Exception as e:  # datasets wraps parse errors in its own exception types
        raise ValueError(f"data.path: could not read {path!r} (split {cfg.split!r}): {type(e).__name__}: {e}") from e
    columns: dict[str, list[Any]] = table.to_dict()
    num_rows = table.num_rows
    if num_rows == 0:
        raise ValueError(f"data.path: {path!r} has no rows")

    for key, config_key in ((cfg.prompt_key, "data.prompt_key"), (cfg.answer_key, "data.answer_key")):
        values = columns.get(key)
        missing = 0 if values is None else next((i for i, v in enumerate(values) if v is None), None)
        if values is None:
            raise ValueError(f"{path}: row 1: missing field {key!r} (named by {config_key}), and no row "
                             f"has it; columns: {', '.join(table.column_names)}")
        if missing is not None:
            raise ValueError(f"{path}: row {missing + 1}: missing field {key!r} (named by {config_key}), "
                             "or it is null")
    texts = columns[cfg.prompt_key]
    for i, text in enumerate(texts):
        if not isinstance(text, str) or not text:
            raise ValueError(f"{path}: row {i + 1}: prompt field {cfg.prompt_key!r} must be a non-empty "
                             f"string, got {text!r}")

    keep = num_rows if cfg.num_samples == 0 else min(cfg.num_samples, num_rows)
    others = [k for k in table.column_names if k not in (cfg.prompt_key, cfg.answer_key)]
    return _Rows(indices=list(range(keep)), texts=texts[:keep],
                 answers=[_answer_str(v) for v in columns[cfg.answer_key][:keep]],
                 metas=[{k: columns[k][i] for k in others} for i in range(keep)])


def _answer_str(value: Any) -> str:
    # JSON readers turn an int column that also holds a float into floats (3 -> 3.0); an integral
    # float most likely was written as an integer, and exact-match rewards compare strings.
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _make_synthetic(name: str, *, num_samples: int, seed: int, args: dict | None = None) -> _Rows:
    task = get_task(name, args)
    rng = random.Random(seed)
    count = num_samples or DEFAULT_SYNTHETIC_SAMPLES
    pairs = [task.make(rng) for _ in range(count)]
    return _Rows(indices=list(range(count)), texts=[p for p, _ in pairs], answers=[a for _, a in pairs],
                 metas=[{"task": name, **task.meta} for _ in range(count)])


def _tokenize(texts: list[str], tokenizer: Any, *, chat_template: bool) -> list[list[int]]:
    if chat_template:
        # Render to text, then tokenize without special tokens: templates spell out BOS themselves.
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True) for t in texts]
    return [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
