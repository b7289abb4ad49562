"""Samples and the trainer batch built from them (pure torch).

A `Sample` is one response to one prompt, token in / token out: the ids the engine generated are
kept as generated (never re-tokenised), with the behavior logprob of each and the policy versions
that produced them. `collate` right-pads a list of samples into a `TrainBatch`, the trainer's batch
(per-token fields aligned with `tokens`).
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch


REWARD_LIMIT = 1e30
"""Largest |reward| a sample may carry into training: within it a group's mean and squared deviations
(float64) and an unnormalised advantage (float32, up to 2e30) stay finite, where a finite 1e308 overflows
them and its group's advantages came out 0 or NaN. The rollout drops a group with a reward beyond it
(or NaN/inf) as a failed reward, counted in reward_overflow; compute_advantages refuses one."""


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
    token_versions: Optional[list[int]] = None
    """Per response token, when they differ (generation spanned a push) or some are unknown (−1: an
    engine without weight-version spans answered across a push); None = every token is version_end's."""
    prompt_index: int = -1  # the dataset item the prompt came from
    finish_reason: str = "stop"  # stop | length (abort never reaches training)
    reward_failed: bool = False
    num_resumes: int = 0  # times generation was aborted at a push and resumed from its prefix
    response_mask: Optional[list[int]] = None  # multi-turn: 1 = model token (trained), 0 = observation
    routed_experts: Optional[torch.Tensor] = None
    """MoE: the experts the engine routed each token to, [P + R - 1, layers * top_k] (row t: token t was
    the input; the last token was never fed). Set when the rollout asked for routes (R3)."""
    teacher_logprobs: Optional[list[float]] = None
    """On-policy distillation: log π_teacher of each response token, teacher-forced (distill.teacher)."""
    teacher_topk_ids: Optional[list[list[int]]] = None
    """distill.topk = K: the teacher's K most likely tokens at each response position, [R][K]."""
    teacher_topk_logprobs: Optional[list[list[float]]] = None
    """Their teacher logprobs, [R][K] (set with teacher_topk_ids)."""

    def __post_init__(self) -> None:
        if len(self.behavior_logprobs) != len(self.response_ids):
            raise ValueError(
                f"sample has {len(self.response_ids)} response tokens but "
                f"{len(self.behavior_logprobs)} behavior logprobs"
            )
        if self.response_mask is not None and len(self.response_mask) != len(self.response_ids):
            raise ValueError(f"sample has {len(self.response_ids)} response tokens but "
                             f"{len(self.response_mask)} response mask entries")
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != len(self.response_ids):
            raise ValueError(f"sample has {len(self.response_ids)} response tokens but "
                             f"{len(self.teacher_logprobs)} teacher logprobs")
        if (self.teacher_topk_ids is None) != (self.teacher_topk_logprobs is None):
            raise ValueError("sample has teacher_topk_ids without teacher_topk_logprobs or the other way round")
        if self.teacher_topk_ids is not None:
            rows = (self.teacher_topk_ids, self.teacher_topk_logprobs)
            if any(len(r) != len(self.response_ids) for r in rows):
                raise ValueError(f"sample has {len(self.response_ids)} response tokens but {len(rows[0])} teacher "
                                 f"top-k id rows and {len(rows[1])} logprob rows")
            widths = {len(r) for part in rows for r in part}
            if len(widths) > 1:
                raise ValueError(f"teacher top-k rows of a sample must all have the same width, got {sorted(widths)}")
        if self.token_versions is not None and len(self.token_versions) != len(self.response_ids):
            raise ValueError(f"sample has {len(self.response_ids)} response tokens but "
                             f"{len(self.token_versions)} token versions")
        if self.routed_experts is not None:
            rows = len(self.prompt_ids) + len(self.response_ids) - 1
            if self.routed_experts.dim() != 2 or self.routed_experts.shape[0] != rows:
                raise ValueError(f"sample has {rows + 1} tokens, so routed_experts must be [{rows}, layers * "
                                 f"top_k], got shape {tuple(self.routed_experts.shape)}")

    def versions_per_token(self) -> list[int]:
        """The policy version that sampled each response token (−1 = unknown)."""
        if self.token_versions is not None:
            return list(self.token_versions)
        return [self.version_end] * len(self.response_ids)


def decode_routes(text: str, rows: int) -> torch.Tensor:
    """SGLang's `meta_info.routed_experts` (base64 of little-endian int32, [rows, layers, top_k]
    flattened) → [rows, layers * top_k] in the smallest integer type that holds the expert ids."""
    flat = np.frombuffer(base64.b64decode(text, validate=True), dtype="<i4")
    if rows <= 0 or flat.size % rows:
        raise ValueError(f"routed_experts holds {flat.size} ids, not a whole number of rows for {rows} tokens")
    routes = torch.from_numpy(flat.astype(np.int32)).view(rows, flat.size // rows)
    return compact_routes(routes)


def encode_routes(routes: torch.Tensor) -> str:
    """The inverse of `decode_routes` (the layout SGLang sends)."""
    return base64.b64encode(routes.to(torch.int32).numpy().astype("<i4").tobytes()).decode("ascii")


def compact_routes(routes: torch.Tensor) -> torch.Tensor:
    """Expert ids stored in uint8 / int16 when they fit (a long rollout holds layers × top_k per token)."""
    if routes.numel() and (int(routes.min()) < 0):
        raise ValueError(f"routed_experts has a negative expert id {int(routes.min())}")
    top = int(routes.max()) if routes.numel() else 0
    return routes.to(torch.uint8 if top < 256 else torch.int16 if top < 32768 else torch.int32)


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


PER_TOKEN = ("tokens", "loss_mask", "behavior_logprobs", "advantages", "proximal_logprobs", "reference_logprobs",
             "behavior_lag", "teacher_logprobs")
PER_SAMPLE = ("lengths", "rewards", "group_ids", "staleness", "prompt_lengths")
PER_TOKEN_ROWS = ("routed_experts", "teacher_topk_ids", "teacher_topk_logprobs")  # [B, S, k]: a row per token


@dataclasses.dataclass
class TrainBatch:
    """What the trainer trains on: B samples right-padded to a width S (per-token fields [B, S],
    column t belonging to token t), per-sample fields [B]. Optional fields are None when a step does
    not compute them. The same type is each micro-batch's view handed to the loss."""

    tokens: torch.Tensor
    """[B, S] token ids (prompt + response), padded."""
    loss_mask: torch.Tensor
    """[B, S] 1 on the tokens that train (model-sampled response tokens), 0 elsewhere."""
    lengths: Optional[torch.Tensor] = None
    """[B] tokens of each sample (prompt + response); None = every row is full width."""
    behavior_logprobs: Optional[torch.Tensor] = None
    """[B, S] logprob of each token under the engine that sampled it (0 off the response)."""
    advantages: Optional[torch.Tensor] = None
    """[B, S] advantage of each token (0 off the response)."""
    proximal_logprobs: Optional[torch.Tensor] = None
    """[B, S] logprobs under the weights the step starts from (π_prox), when the loss needs them."""
    reference_logprobs: Optional[torch.Tensor] = None
    """[B, S] logprobs under the reference (start) weights, for a KL penalty."""
    behavior_lag: Optional[torch.Tensor] = None
    """[B, S] versions between the weights that sampled each response token and this step's (0 off the
    response); set when π_prox is approximated instead of recomputed (losses/proximal.py)."""
    teacher_logprobs: Optional[torch.Tensor] = None
    """[B, S] log π_teacher of each response token (0 off the response); set when on-policy distillation
    takes the student's logprobs from the training forward (losses/distill.py)."""
    teacher_topk_ids: Optional[torch.Tensor] = None
    """[B, S, K] the teacher's K most likely tokens at each response token's position (0 off the
    response); set with distill.topk: the loss takes the student's logprobs of them from its forward."""
    teacher_topk_logprobs: Optional[torch.Tensor] = None
    """[B, S, K] the teacher's logprobs of teacher_topk_ids (0 off the response)."""
    rewards: Optional[torch.Tensor] = None
    """[B] reward of each sample."""
    group_ids: Optional[torch.Tensor] = None
    """[B] the group (prompt) each sample answers."""
    staleness: Optional[torch.Tensor] = None
    """[B] policy versions between the sample's generation start and this step."""
    prompt_lengths: Optional[torch.Tensor] = None
    """[B] tokens of each sample's prompt (the first tokens; trainer.shared_prefix computes a group's once)."""
    routed_experts: Optional[torch.Tensor] = None
    """[B, S, layers * top_k] the engine's experts for token t (MoE routing replay); the model
    input's, not the loss's (micro-batches lay it out with the tokens)."""

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2:
            raise ValueError(f"TrainBatch.tokens must be [B, S], got shape {tuple(self.tokens.shape)}")
        b, s = self.tokens.shape
        for name, value in self.fields():
            want = (b, s) if name in PER_TOKEN else (b,)
            if name in PER_TOKEN_ROWS:
                want = (b, s, value.shape[-1] if value.dim() == 3 else -1)
            if tuple(value.shape) != want:
                raise ValueError(f"TrainBatch.{name} must have shape {want} (like tokens "
                                 f"{tuple(self.tokens.shape)}), got {tuple(value.shape)}")

    @property
    def num_samples(self) -> int:
        return int(self.tokens.shape[0])

    def fields(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of every field that is set."""
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if getattr(self, f.name) is not None]

    def replace(self, **changes: Optional[torch.Tensor]) -> "TrainBatch":
        return dataclasses.replace(self, **changes)

    def map(self, per_token: Callable[[torch.Tensor], torch.Tensor],
            per_sample: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
            drop: Sequence[str] = ()) -> "TrainBatch":
        """A new batch with `per_token` applied to every [B, S] field and `per_sample` (default: the
        same function) to every [B] field; fields in `drop` become None."""
        per_sample = per_sample or per_token
        return TrainBatch(**{name: None if name in drop else
                             (per_token if name in PER_TOKEN + PER_TOKEN_ROWS else per_sample)(value)
                             for name, value in self.fields()})

    def rows(self, index: Any) -> "TrainBatch":
        """The samples at `index` (a slice, or a tensor of row indices), every field."""
        return self.map(lambda t: t[index])


def collate(samples: Sequence[Sample], *, pad_id: int, advantages: Optional[torch.Tensor] = None,
            pad_to_multiple: int = 1) -> TrainBatch:
    """Right-pad samples into a TrainBatch (tokens, lengths, loss_mask, behavior_logprobs, rewards,
    group_ids, and per-token advantages when given per sample). `pad_to_multiple` rounds the padded
    width up (the trainer's padded layout; packed micro-batches use `lengths` and ignore the width)."""
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
    per_token_adv = None
    if advantages is not None:
        if advantages.shape != (n,):
            raise ValueError(f"advantages must have shape ({n},), got {tuple(advantages.shape)}")
        per_token_adv = advantages.float()[:, None] * mask
    return TrainBatch(tokens=tokens, lengths=torch.tensor(lengths, dtype=torch.long), loss_mask=mask,
                      behavior_logprobs=behavior, advantages=per_token_adv, routed_experts=_collate_routes(samples, width),
                      rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
                      group_ids=torch.tensor([s.group_id for s in samples], dtype=torch.long),
                      prompt_lengths=torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long))


def _collate_routes(samples: Sequence[Sample], width: int) -> Optional[torch.Tensor]:
    """[B, width, layers * top_k] of the samples' routes (0 where a token has none), or None when no
    sample carries routes; all or none must."""
    have = [s.routed_experts is not None for s in samples]
    if not any(have):
        return None
    if not all(have):
        missing = have.index(False)
        raise ValueError(f"sample {missing} (prompt {samples[missing].prompt_index}) has no routed_experts "
                         "while others of the batch do: routing replay needs every sample's routes")
    cols = {int(s.routed_experts.shape[1]) for s in samples}
    if len(cols) != 1:
        raise ValueError(f"samples carry routed_experts of different widths {sorted(cols)} (layers * top_k)")
    dtype = max((s.routed_experts.dtype for s in samples), key=lambda d: torch.iinfo(d).bits)
    out = torch.zeros(len(samples), width, cols.pop(), dtype=dtype)
    for i, s in enumerate(samples):
        out[i, : s.routed_experts.shape[0]] = s.routed_experts.to(dtype)
    return out
