"""Samples and the trainer batch built from them (pure torch).

A `Sample` is one response to one prompt, token in / token out: the ids the engine generated are
kept as generated (never re-tokenised), with the behavior logprob of each and the policy versions
that produced them. `collate` right-pads a list of samples into the trainer's batch layout
(per-token fields aligned with `tokens`; see megatron_flash/trainer/policy.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch


@dataclasses.dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    behavior_logprobs: list[float]
    reward: float = 0.0
    group_id: int = 0
    finished: bool = True
    version_start: int = 0  # policy version when generation started
    version_end: int = 0  # policy version that produced the last token
    token_versions: Optional[list[int]] = None  # per response token, when generation spanned a push
    prompt_index: int = -1  # the dataset item the prompt came from
    finish_reason: str = "stop"  # stop | length (abort never reaches training)
    reward_failed: bool = False
    num_resumes: int = 0  # times generation was aborted at a push and resumed from its prefix
    response_mask: Optional[list[int]] = None  # multi-turn: 1 = model token (trained), 0 = observation

    def __post_init__(self) -> None:
        if len(self.behavior_logprobs) != len(self.response_ids):
            raise ValueError(
                f"sample has {len(self.response_ids)} response tokens but "
                f"{len(self.behavior_logprobs)} behavior logprobs"
            )
        if self.response_mask is not None and len(self.response_mask) != len(self.response_ids):
            raise ValueError(f"sample has {len(self.response_ids)} response tokens but "
                             f"{len(self.response_mask)} response mask entries")
        if self.token_versions is not None and len(self.token_versions) != len(self.response_ids):
            raise ValueError(f"sample has {len(self.response_ids)} response tokens but "
                             f"{len(self.token_versions)} token versions")


@dataclasses.dataclass
class Group:
    """The n responses to one prompt, finished and rewarded; the unit the buffer stores and the
    trainer takes (group-relative advantages need the whole group)."""

    group_id: int
    prompt_index: int
    samples: list[Sample]
    version_start: int  # min over samples: staleness is counted from the oldest token
    time_submitted: float = 0.0
    time_finished: float = 0.0
    prompt: Any = dataclasses.field(default=None, repr=False, compare=False)
    """The dataset item it answers (kept so a stale group can be regenerated); not serialised."""

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    def __len__(self) -> int:
        return len(self.samples)


def collate(samples: Sequence[Sample], *, pad_id: int, advantages: Optional[torch.Tensor] = None,
            pad_to_multiple: int = 1) -> dict[str, torch.Tensor]:
    """tokens, lengths [B], loss_mask, behavior_logprobs, rewards [B], group_ids [B], and advantages
    per token. `pad_to_multiple` rounds the padded width up (the trainer's padded layout; packed
    micro-batches use `lengths` and ignore the width)."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    width = max(lengths)
    width = -(-width // pad_to_multiple) * pad_to_multiple
    n = len(samples)
    tokens = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros(n, width)
    behavior = torch.zeros(n, width)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        tokens[i, : p + r] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        mask[i, p : p + r] = 1.0 if s.response_mask is None else torch.tensor(s.response_mask, dtype=torch.float32)
        behavior[i, p : p + r] = torch.tensor(s.behavior_logprobs, dtype=torch.float32)
    batch = {
        "tokens": tokens,
        "lengths": torch.tensor(lengths, dtype=torch.long),
        "loss_mask": mask,
        "behavior_logprobs": behavior,
        "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32),
        "group_ids": torch.tensor([s.group_id for s in samples], dtype=torch.long),
    }
    if advantages is not None:
        if advantages.shape != (n,):
            raise ValueError(f"advantages must have shape ({n},), got {tuple(advantages.shape)}")
        batch["advantages"] = advantages.float()[:, None] * mask
    return batch
