"""What a step does to its batch beyond advantages (DAPO's overlong filtering) and the per-step
diagnostics of what trained (train–inference mismatch, length bias). Pure functions over samples
and the TrainBatch; the controller calls them and logs what they return.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from megatron_flash.types import TrainBatch

logger = logging.getLogger(__name__)


def overlong_filter(samples: Sequence[Any], batch: TrainBatch, *, enabled: bool) -> tuple[TrainBatch, dict[str, int]]:
    """rollout.overlong_filter: truncated responses (finish_reason length) leave the loss (their rows
    of loss_mask zeroed). A batch of only truncated responses is trained as is (nothing would be
    left) and flagged."""
    counts = {"overlong_filtered": 0, "overlong_filter_skipped": 0}
    if not enabled:
        return batch, counts
    cut = torch.tensor([s.finish_reason == "length" for s in samples])
    if bool(cut.all()):
        counts["overlong_filter_skipped"] = 1
        logger.warning("overlong filter: all %d responses of this batch are truncated; trained as they are",
                       len(samples))
        return batch, counts
    counts["overlong_filtered"] = int(cut.sum())
    return batch.replace(loss_mask=batch.loss_mask * (~cut).to(batch.loss_mask.dtype)[:, None]), counts


def mismatch_metrics(batch: TrainBatch) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Train–inference mismatch on the sampled tokens of staleness-0 samples (engine and trainer at
    the same version, so staleness plays no part): ({} when there is none or no π_prox).

        train_infer_logprob_diff   mean |log π_train − log μ_engine|
        mismatch_k3                KL(μ‖π) by the k3 estimator on the engine's samples: r − 1 − log r, r = π/μ
        mismatch_log_ppl_gap       log-perplexity of those tokens, engine minus trainer

    and histograms of the per-token and per-sequence log ratios."""
    if batch.proximal_logprobs is None or batch.staleness is None:
        return {}, {}
    fresh = (batch.staleness == 0).float()[:, None] * batch.loss_mask
    if fresh.sum() <= 0:
        return {}, {}
    delta = (batch.proximal_logprobs - batch.behavior_logprobs) * fresh
    k3 = (torch.exp(delta.clamp(-20, 20)) - 1 - delta) * fresh
    tokens = fresh.sum()
    per_seq = delta.sum(-1) / fresh.sum(-1).clamp(min=1)
    metrics = {"train_infer_logprob_diff": float(delta.abs().sum() / tokens), "mismatch_k3": float(k3.sum() / tokens),
               "mismatch_log_ppl_gap": float(delta.sum() / tokens)}
    histograms = {"mismatch/token_log_ratio": delta[fresh > 0],
                  "mismatch/seq_mean_log_ratio": per_seq[fresh.sum(-1) > 0]}
    return metrics, histograms


def length_bias(trained: Sequence[Any], dropped: dict[str, list[int]]) -> dict[str, Any]:
    """Response lengths of what trained this step vs what staleness (`stale`) and the dynamic filter
    (`filtered`) dropped since the last step: mean, p90 and count each (None where nothing). Long
    rollouts starved by the α bound show as a stale mean far above the trained one."""
    def stats(name: str, lengths: list[int]) -> dict[str, Any]:
        ordered = sorted(lengths)
        return {f"len_{name}_mean": sum(ordered) / len(ordered) if ordered else None,
                f"len_{name}_p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] if ordered else None,
                f"len_{name}_n": len(ordered)}

    out = stats("trained", [len(s.response_ids) for s in trained])
    out.update(stats("dropped_stale", dropped.get("stale", [])))
    out.update(stats("dropped_filtered", dropped.get("filtered", [])))
    return out


def token_staleness(samples: Sequence[Any], version: int) -> dict[str, Any]:
    """Staleness of the weights that sampled each trained token (version − its label), not of the
    sample's start: a sample started at v whose tokens came after a push is fresher than V − v says.
    Tokens of unknown version are left out."""
    lags = [version - v for s in samples for v, m in zip(s.versions_per_token(), s.response_mask or
                                                           [1] * len(s.response_ids)) if m and v >= 0]
    return {"staleness_token_mean": sum(lags) / len(lags) if lags else None,
            "staleness_token_max": max(lags) if lags else None}
