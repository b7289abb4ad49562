"""Independent float64 reference for the per-token losses (plain Python floats, math.exp).

Written from the formulas in docs/losses.md, not from megatron_flash.losses: one loop over tokens,
each loss value and its derivative with respect to log π_θ of that token derived by hand:

    d r / d log π_θ = r                 (r = exp(log π_θ − log π_prox), inside the ±20 clamp)
    ppo        −r·A unclipped branch, 0 where the clip (or dual clip) binds
    decoupled  w·(ppo gradient)
    tis/cispo/topr   −w·A (w detached, loss = −w·A·log π_θ)
    reinforce  −A
    kl k1      +1,  k3: 1 − exp(log π_ref − log π_θ)

Outside the ±20 log-ratio clamp the clamped quantity is constant, so its derivative is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

CLAMP = 20.0


def _clamp(x: float, low: float, high: float) -> float:
    return min(max(x, low), high)


def _exp_clamped(log_ratio: float) -> tuple[float, float]:
    """exp(clamp(x)) and d/dx of it."""
    value = math.exp(_clamp(log_ratio, -CLAMP, CLAMP))
    inside = -CLAMP < log_ratio < CLAMP
    return value, value if inside else 0.0


@dataclass
class Result:
    loss: list[list[float]]
    grad: list[list[float]]
    trained: list[list[bool]]
    counts: dict[str, float] = field(default_factory=dict)


def _ppo_token(lp: float, prox: float, adv: float, eps_low: float, eps_high: float,
               dual_clip: float | None) -> tuple[float, float, str]:
    """(loss, dloss/dlp, which branch: 'unclipped' | 'low' | 'high' | 'dual')."""
    r, dr = _exp_clamped(lp - prox)
    low, high = 1.0 - eps_low, 1.0 + eps_high
    rc = _clamp(r, low, high)
    unclipped, clipped = r * adv, rc * adv
    if unclipped <= clipped:
        loss, grad, branch = -unclipped, -dr * adv, "unclipped"
    else:
        loss, grad = -clipped, 0.0
        branch = "high" if r > high else "low"
    if dual_clip is not None and adv < 0 and -dual_clip * adv < loss:
        loss, grad, branch = -dual_clip * adv, 0.0, "dual"
    return loss, grad, branch


def reference_loss(
    name: str,
    params: dict,
    *,
    logprobs: list[list[float]],
    behavior: list[list[float]],
    proximal: list[list[float]] | None,
    advantages: list[list[float]],
    mask: list[list[float]],
    rewards: list[float],
    reference: list[list[float]] | None = None,
) -> Result:
    """Per-token loss, gradient w.r.t. logprobs, trained-token mask and counts for loss ``name``."""
    p = dict(params)
    mismatch = p.pop("mismatch_mask", "off")
    mm_low = p.pop("mismatch_low", 0.5)
    mm_high = p.pop("mismatch_high", 2.0)
    kl_coef = p.pop("kl_coef", 0.0)
    kl_est = p.pop("kl_estimator", "k3")
    num_seqs, num_pos = len(logprobs), len(logprobs[0])
    prox = proximal if proximal is not None else behavior

    # 1. train–inference mismatch masking (needs proximal logprobs)
    keep = [[mask[b][t] != 0 for t in range(num_pos)] for b in range(num_seqs)]
    if mismatch != "off" and proximal is not None:
        for b in range(num_seqs):
            if mismatch == "token":
                for t in range(num_pos):
                    if keep[b][t]:
                        ratio = math.exp(_clamp(proximal[b][t] - behavior[b][t], -CLAMP, CLAMP))
                        if ratio < mm_low or ratio > mm_high:
                            keep[b][t] = False
            else:
                logs = [proximal[b][t] - behavior[b][t] for t in range(num_pos) if mask[b][t] != 0]
                if logs:
                    geo = math.exp(_clamp(sum(logs) / len(logs), -CLAMP, CLAMP))
                    if geo < mm_low or geo > mm_high:
                        keep[b] = [False] * num_pos
    after_mismatch = [row[:] for row in keep]

    loss = [[0.0] * num_pos for _ in range(num_seqs)]
    grad = [[0.0] * num_pos for _ in range(num_seqs)]
    counts = {"clip_low": 0.0, "clip_high": 0.0, "clip_dual": 0.0, "cap_dropped": 0.0}
    weights: list[float] = []

    # 2. the loss formula on surviving tokens
    for b in range(num_seqs):
        seq_log_rho = sum(logprobs[b][t] - behavior[b][t] for t in range(num_pos) if keep[b][t])
        for t in range(num_pos):
            if not keep[b][t]:
                continue
            lp, mu, px, adv = logprobs[b][t], behavior[b][t], prox[b][t], advantages[b][t]
            if name == "ppo":
                value, g, branch = _ppo_token(lp, px, adv, p.get("eps_low", 0.2),
                                              p.get("eps_high", 0.2), p.get("dual_clip"))
                weights.append(math.exp(_clamp(lp - px, -CLAMP, CLAMP)))
            elif name == "decoupled_ppo":
                w = math.exp(_clamp(px - mu, -CLAMP, CLAMP))
                cap = p.get("weight_cap")
                if cap is not None and w > cap:
                    keep[b][t] = False
                    counts["cap_dropped"] += 1
                    continue
                value, g, branch = _ppo_token(lp, px, adv, p.get("eps_low", 0.2),
                                              p.get("eps_high", 0.2), None)
                value, g = w * value, w * g
                weights.append(w)
            elif name in ("tis", "cispo", "topr", "reinforce"):
                rho = math.exp(_clamp(lp - mu, -CLAMP, CLAMP))
                branch = "unclipped"
                if name == "tis":
                    low, high = p.get("lower", 0.0), p.get("upper", 1.0)
                elif name == "cispo":
                    low, high = 1.0 - p.get("eps_low", 1.0), 1.0 + p.get("eps_high", 0.2)
                elif name == "topr":
                    if p.get("level", "token") == "sequence":
                        rho = math.exp(_clamp(seq_log_rho, -CLAMP, CLAMP))
                    low, high = (1.0, 1.0) if rewards[b] > 0 else (0.0, 1.0)
                    if rewards[b] > 0:
                        rho = 1.0
                else:
                    low, high, rho = 1.0, 1.0, 1.0
                if rho > high:
                    branch = "high"
                elif rho < low:
                    branch = "low"
                w = _clamp(rho, low, high)
                value, g = -w * adv * lp, -w * adv
                weights.append(w)
            else:
                raise ValueError(name)
            if branch in ("low", "high", "dual"):
                counts["clip_" + branch] += 1
            # 3. KL to the reference policy
            if reference is not None and kl_coef > 0:
                if kl_est == "k1":
                    kl, dkl = lp - reference[b][t], 1.0
                else:
                    delta = reference[b][t] - lp
                    dc = _clamp(delta, -CLAMP, CLAMP)
                    kl = math.exp(dc) - dc - 1.0
                    dkl = (1.0 - math.exp(dc)) if -CLAMP < delta < CLAMP else 0.0
                value, g = value + kl_coef * kl, g + kl_coef * dkl
            loss[b][t], grad[b][t] = value, g

    num_masked = sum(1 for b in range(num_seqs) for t in range(num_pos) if mask[b][t] != 0)
    num_trained = sum(1 for b in range(num_seqs) for t in range(num_pos) if keep[b][t])
    num_mismatch = num_masked - sum(1 for row in after_mismatch for k in row if k)
    counts.update(num_masked=num_masked, num_trained=num_trained, mismatch_dropped=num_mismatch)
    if weights:
        counts.update(w_mean=sum(weights) / len(weights), w_max=max(weights), w_min=min(weights))
    return Result(loss, grad, keep, counts)


def reference_approx_kl(logprobs, behavior, trained) -> float:
    """Mean over trained tokens of (r − 1) − log r, r = π_θ/μ (k3 estimate of KL(μ‖π_θ))."""
    values = []
    for b, row in enumerate(trained):
        for t, on in enumerate(row):
            if on:
                x = _clamp(logprobs[b][t] - behavior[b][t], -CLAMP, CLAMP)
                values.append(math.exp(x) - 1.0 - x)
    return sum(values) / len(values) if values else 0.0
