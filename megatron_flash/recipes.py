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


def teacher_logprobs(samples: Sequence[Any], loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, S] log π_teacher of each response token in collate's layout (0 off the response); a sample
    without teacher logprobs (e.g. replayed from a run without a teacher) is named."""
    out = torch.zeros_like(loss_mask, dtype=torch.float32)
    for i, s in enumerate(samples):
        if s.teacher_logprobs is None:
            raise ValueError(f"distill.teacher is set but sample {i} (prompt {s.prompt_index}) carries no teacher "
                             "logprobs (replayed from a run without a teacher?)")
        start = len(s.prompt_ids)
        out[i, start:start + len(s.teacher_logprobs)] = torch.tensor(s.teacher_logprobs, dtype=torch.float32)
    return out * (loss_mask != 0)


def teacher_topk(samples: Sequence[Any], loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, S, K] ids, [B, S, K] logprobs) of the teacher's top-K at each response token in collate's
    layout (0 off the trained tokens); a sample without them (e.g. replayed from a run without
    distill.topk) or with another K is named."""
    widths = {len(s.teacher_topk_ids[0]) for s in samples if s.teacher_topk_ids}
    k = widths.pop() if len(widths) == 1 else 0
    b, width = loss_mask.shape
    ids = torch.zeros(b, width, max(k, 1), dtype=torch.long)
    lps = torch.zeros(b, width, max(k, 1), dtype=torch.float32)
    for i, s in enumerate(samples):
        if s.teacher_topk_ids is None:
            raise ValueError(f"distill.topk is set but sample {i} (prompt {s.prompt_index}) carries no teacher top-k "
                             "(replayed from a run without distill.topk?)")
        if s.teacher_topk_ids and len(s.teacher_topk_ids[0]) != k:
            raise ValueError(f"sample {i} (prompt {s.prompt_index}) carries a teacher top-{len(s.teacher_topk_ids[0])}, "
                             f"others of the batch {sorted(widths | {k})}")
        start, r = len(s.prompt_ids), len(s.teacher_topk_ids)
        if r:
            ids[i, start:start + r] = torch.tensor(s.teacher_topk_ids, dtype=torch.long)
            lps[i, start:start + r] = torch.tensor(s.teacher_topk_logprobs, dtype=torch.float32)
    keep = (loss_mask != 0)[..., None]
    return ids * keep, lps * keep


def distill_metrics(samples: Sequence[Any]) -> dict[str, float]:
    """distill/reverse_kl (mean k_t per response token) and distill/teacher_logprob (mean log π_teacher),
    over model tokens of the samples that carry teacher logprobs ({} when none does)."""
    kl, teacher, n = 0.0, 0.0, 0
    for s in samples:
        if s.teacher_logprobs is None:
            continue
        mask = s.response_mask or [1] * len(s.response_ids)
        for mu, t, m in zip(s.behavior_logprobs, s.teacher_logprobs, mask):
            if m:
                kl, teacher, n = kl + (mu - t), teacher + t, n + 1
    return {"distill/reverse_kl": kl / n, "distill/teacher_logprob": teacher / n} if n else {}


def behavior_lags(samples: Sequence[Any], version: int, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, S] of version − the label of the weights that sampled each response token (collate's layout:
    a sample's response starts after its prompt); an unknown label (−1) counts as the sample's first
    version, the oldest it can be. 0 off the response."""
    lags = torch.zeros_like(loss_mask, dtype=torch.float32)
    for i, s in enumerate(samples):
        start = len(s.prompt_ids)
        row = [version - (v if v >= 0 else s.version_start) for v in s.versions_per_token()]
        lags[i, start:start + len(row)] = torch.tensor(row, dtype=torch.float32)
    return lags * (loss_mask != 0)


def token_staleness(samples: Sequence[Any], version: int) -> dict[str, Any]:
    """Staleness of the weights that sampled each trained token (version − its label), not of the
    sample's start: a sample started at v whose tokens came after a push is fresher than V − v says.
    Tokens of unknown version are left out."""
    lags = [version - v for s in samples for v, m in zip(s.versions_per_token(), s.response_mask or
                                                           [1] * len(s.response_ids)) if m and v >= 0]
    return {"staleness_token_mean": sum(lags) / len(lags) if lags else None,
            "staleness_token_max": max(lags) if lags else None}
