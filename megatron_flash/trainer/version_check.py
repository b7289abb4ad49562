"""The train–inference gap at each token's labelled version, at any α.

Every response token carries the policy version whose weights sampled it (`Sample.versions_per_token`:
the engine's weight-version spans). Staleness and every off-policy correction trust that label. The
trainer's own check at staleness 0 (`recipes.mismatch_metrics`) cannot see a wrong label once rollout
runs ahead — at α = 2 no trained token is fresh — so this one keeps the weights themselves:

    step V starts ──► V % interval == 0: host copy of this rank's weights, labelled V
                      (the weights push V sent; kept until step V + α, the last that can train a
                      token of V)
    each step    ──► tokens of the batch labelled with a kept version v: their logprobs under copy v
                      (weights swapped in, one forward of those samples, swapped back bit-exactly)
                      mismatch_labelled_abs = mean |log π_v − log μ| over them

Right labels leave only numerics (≈1e-6 per token in fp32, the engine's kernels against Megatron's);
a token sampled by other weights than its label shows the policy's movement between them (O(0.1) on
the quickstart task). interval = 1 keeps a copy of every version (α + 1 at a time) and so checks every
token whose version is known: the diagnostic mode; a larger interval samples versions and holds one
copy at a time when interval > α.

With pause mode in_place a token sampled after a push attended to KV the older weights wrote: no single
version's weights give its μ (SGLang behaves the same). Such tokens — a version above the sample's
first token's — are left out of the labelled gap and scored apart under their own label:
`mismatch_mixed_abs` / `_max` / `_tokens` (what continuing on old KV costs), and
`mismatch_labelled_mixed_tokens` counts them every step.

Runs on every trainer rank (the forward is collective); every rank sees the same samples and decides
alike.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch

from megatron_flash.types import TrainBatch


class WeightSnapshots:
    """Host copies of a list of modules' parameters, by policy version."""

    def __init__(self, modules: Sequence[torch.nn.Module]) -> None:
        self._params = [p for m in modules for p in m.parameters() if p.requires_grad]  # LoRA: the adapters
        self._copies: dict[int, list[torch.Tensor]] = {}

    @property
    def versions(self) -> list[int]:
        return sorted(self._copies)

    def take(self, version: int) -> None:
        self._copies[version] = [p.detach().to("cpu", copy=True) for p in self._params]

    def drop_before(self, version: int) -> None:
        for v in [v for v in self._copies if v < version]:
            del self._copies[v]

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped(self, version: int) -> Iterator[None]:
        """The modules hold copy `version` inside the block, their own values again after it."""
        own = [p.detach().to("cpu", copy=True) for p in self._params]
        try:
            for p, saved in zip(self._params, self._copies[version]):
                p.data.copy_(saved)
            yield
        finally:
            for p, saved in zip(self._params, own):
                p.data.copy_(saved)


class VersionCheck:
    """Per step: snapshot when due, then the gap of the batch's tokens of every kept version."""

    def __init__(self, policy: Any, *, interval: int, alpha: int, mixed_after_push: bool) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.policy, self.interval, self.alpha = policy, interval, alpha
        self.mixed_after_push = mixed_after_push
        self.snapshots = WeightSnapshots(policy.chunks)

    def step(self, version: int, samples: Sequence[Any], batch: TrainBatch) -> dict[str, float]:
        """Call before training step `version` (its weights are still those of push `version`)."""
        if version % self.interval == 0:
            self.snapshots.take(version)
        labels, mixed = token_labels(samples, batch, mixed_after_push=self.mixed_after_push)
        gaps: dict[bool, list[torch.Tensor]] = {False: [], True: []}
        for v in self.snapshots.versions:
            mask = labels == v
            rows = mask.any(dim=1).nonzero().flatten()
            if rows.numel() == 0:
                continue
            with self.snapshots.swapped(v):
                lp = self.policy.compute_logprobs(batch.rows(rows))[0]
            gap = (lp - batch.behavior_logprobs[rows]).abs()
            for is_mixed in (False, True):
                gaps[is_mixed].append(gap[mask[rows] & (mixed[rows] == is_mixed)])
        # Tokens of v can still come until step v + α: keep v while the next step may see it.
        self.snapshots.drop_before(version + 1 - self.alpha)
        out = {"mismatch_labelled_mixed_tokens": float(mixed.sum())} if self.mixed_after_push else {}
        for name, is_mixed in (("mismatch_labelled", False), ("mismatch_mixed", True)):
            values = torch.cat(gaps[is_mixed]) if gaps[is_mixed] else torch.zeros(0)
            if values.numel():
                out.update({f"{name}_abs": float(values.mean()), f"{name}_max": float(values.max()),
                            f"{name}_tokens": float(values.numel())})
        return out


def token_labels(samples: Sequence[Any], batch: TrainBatch, *,
                 mixed_after_push: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S] version label of every trained token of `batch` (rows = `samples`, collated in order),
    −1 where there is none (prompt, padding, an observation token, an unknown version); and [B, S]
    bool: the token attended to KV of older weights (in_place, a version above the sample's first)."""
    labels = torch.full(tuple(batch.tokens.shape), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        p, versions = len(s.prompt_ids), s.versions_per_token()
        labels[i, p:p + len(versions)] = torch.tensor(versions, dtype=torch.long)
    labels = torch.where(batch.loss_mask > 0, labels, torch.full_like(labels, -1))
    mixed = torch.zeros_like(labels, dtype=torch.bool)
    if mixed_after_push:
        first = torch.tensor([(s.versions_per_token() or [-1])[0] for s in samples], dtype=torch.long)
        mixed = (labels > first[:, None]) & (first[:, None] >= 0)
    return labels, mixed
