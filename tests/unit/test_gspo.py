"""GSPO against an independent float64 reference (plain Python floats, one loop per sequence).

Written from the formula (docs/losses.md), not from the code:

    log s_i = Σ_t m_t (lp_t − old_t) / Σ_t m_t,   s_i = exp(clamp(log s_i, ±20))
    A_i     = Σ_t m_t A_t / Σ_t m_t
    L_i     = −min(s_i A_i, clip(s_i, 1−ε_low, 1+ε_high) A_i)      on every trained token of i
    d(Σ_t L_t)/d lp_t' = n_i · dL_i/d lp_t' = −A_i s_i m_t'   (unclipped branch, inside the clamp), else 0

m is the response mask after mismatch masking (token mode: keep 0.8 ≤ exp(old − μ) ≤ 1.25). With the
behaviour weight (behavior_weight="sequence") every L_i and its gradient are multiplied by
the constant w_i = min(exp(Σ_t m_t (old_t − μ_t) / Σ_t m_t), cap).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_flash.losses import aggregate, get_loss

B, T = 7, 9


def inputs(seed: int, spread: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3 - 0.05
    old = lp + spread * torch.randn(B, T, generator=gen, dtype=torch.float64)
    behavior = old + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=gen, dtype=torch.float64).expand(B, T).clone()
    mask = (torch.rand(B, T, generator=gen) > 0.3).to(torch.float64)
    mask[-1] = 0.0  # a sequence without response tokens
    return dict(logprobs=lp, proximal_logprobs=old, behavior_logprobs=behavior, advantages=adv, loss_mask=mask)


def reference(x: dict[str, torch.Tensor], eps_low: float, eps_high: float, mismatch: bool, cap: float | None = None):
    """cap None: the paper's formula (behavior_weight="none"); else the truncated sequence weight."""
    lp, old, mu = x["logprobs"].tolist(), x["proximal_logprobs"].tolist(), x["behavior_logprobs"].tolist()
    adv, mask = x["advantages"].tolist(), x["loss_mask"].tolist()
    loss = [[0.0] * T for _ in range(B)]
    grad = [[0.0] * T for _ in range(B)]
    clipped = {"low": 0, "high": 0, "seqs": 0}
    for i in range(B):
        m = [1.0 if mask[i][t] and (not mismatch or 0.8 <= math.exp(old[i][t] - mu[i][t]) <= 1.25) else 0.0
             for t in range(T)]
        n = sum(m)
        if n == 0:
            continue
        clipped["seqs"] += 1
        log_s = sum(m[t] * (lp[i][t] - old[i][t]) for t in range(T)) / n
        s = math.exp(min(max(log_s, -20.0), 20.0))
        a = sum(m[t] * adv[i][t] for t in range(T)) / n
        w = 1.0 if cap is None else min(math.exp(sum(m[t] * (old[i][t] - mu[i][t]) for t in range(T)) / n), cap)
        clipped["capped"] = clipped.get("capped", 0) + (cap is not None and w == cap)
        sc = min(max(s, 1 - eps_low), 1 + eps_high)
        unclipped = s * a <= sc * a
        value = w * (-(s * a) if unclipped else -(sc * a))
        if not unclipped:
            clipped["low" if s < 1 - eps_low else "high"] += 1
        for t in range(T):
            if m[t]:
                loss[i][t] = value
                grad[i][t] = -w * a * s if unclipped and -20 < log_s < 20 else 0.0
    return loss, grad, clipped


@pytest.mark.parametrize("cap", [None, 2.0, 1.02])
@pytest.mark.parametrize("mismatch", [False, True])
@pytest.mark.parametrize("eps_low,eps_high,spread", [(3e-4, 4e-4, 0.05), (0.1, 0.2, 0.3), (0.2, 0.28, 1e-5)])
@pytest.mark.parametrize("seed", [0, 1])
def test_values_gradients_and_clip_fractions_match_the_reference(seed, eps_low, eps_high, spread, mismatch, cap):
    x = inputs(seed, spread)
    params = {"eps_low": eps_low, "eps_high": eps_high}
    params.update({"behavior_weight": "none"} if cap is None else {"behavior_weight": "sequence", "weight_cap": cap})
    if mismatch:
        params.update(mismatch_mask="token", mismatch_low=0.8, mismatch_high=1.25)
    lp = x["logprobs"].clone().requires_grad_(True)
    per_token, metrics = get_loss("gspo", **params)(**{**x, "logprobs": lp})
    per_token.sum().backward()
    want_loss, want_grad, clipped = reference(x, eps_low, eps_high, mismatch, cap)
    if cap is not None:
        assert metrics["seq_is_capped_frac"].item() == pytest.approx(clipped["capped"] / clipped["seqs"])
    torch.testing.assert_close(per_token.detach(), torch.tensor(want_loss, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lp.grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    assert metrics["clip_frac_seq_low"].item() == pytest.approx(clipped["low"] / clipped["seqs"])
    assert metrics["clip_frac_seq_high"].item() == pytest.approx(clipped["high"] / clipped["seqs"])


def test_the_cases_clip_both_sides_and_leave_some_unclipped():
    """Guards the test's power: the parametrised inputs hit each branch."""
    seen = {"low": 0, "high": 0, "open": 0}
    for seed in (0, 1):
        for eps_low, eps_high, spread in [(3e-4, 4e-4, 0.05), (0.1, 0.2, 0.3), (0.2, 0.28, 1e-5)]:
            _, grad, clipped = reference(inputs(seed, spread), eps_low, eps_high, False, 1.02)
            seen["capped"] = seen.get("capped", 0) + clipped["capped"]
            seen["uncapped"] = seen.get("uncapped", 0) + clipped["seqs"] - clipped["capped"]
            seen["low"] += clipped["low"]
            seen["high"] += clipped["high"]
            seen["open"] += clipped["seqs"] - clipped["low"] - clipped["high"]
    assert all(v > 0 for v in seen.values()), seen


def test_with_seq_mean_token_mean_the_objective_is_the_mean_over_sequences():
    x = inputs(3, 0.3)
    per_token, _ = get_loss("gspo", eps_low=0.1, eps_high=0.2, behavior_weight="sequence")(**x)
    loss_sum, denominator = aggregate(per_token, x["loss_mask"], mode="seq_mean_token_mean")
    want, _, clipped = reference(x, 0.1, 0.2, False, 1.0)
    per_seq = [next((v for v in row if v != 0.0), 0.0) for row in want]
    assert denominator.item() == clipped["seqs"] == B - 1
    assert (loss_sum / denominator).item() == pytest.approx(sum(per_seq) / clipped["seqs"], rel=1e-12)


def test_gspo_reads_the_proximal_policy_and_defaults_to_the_papers_clip():
    loss = get_loss("gspo")
    assert loss.needs_proximal and loss.params["eps_low"] == 3e-4 and loss.params["eps_high"] == 4e-4
    with pytest.raises(ValueError, match="eps_low"):
        get_loss("gspo", eps_low=1.5)


def test_behaviour_weight_is_the_default_and_the_paper_form_is_on_policy():
    assert get_loss("gspo").params["behavior_weight"] == "token" and not get_loss("gspo").on_policy
    assert not get_loss("gspo", behavior_weight="sequence").on_policy
    assert get_loss("gspo", behavior_weight="none").on_policy
    with pytest.raises(ValueError, match="behavior_weight"):
        get_loss("gspo", behavior_weight="tokens")
    with pytest.raises(ValueError, match="weight_cap"):
        get_loss("gspo", weight_cap=0.0)


def token_reference(x: dict[str, torch.Tensor], eps_low: float, eps_high: float, cap: float):
    """behavior_weight="token" (GSPO-token): the value of token t is −w_t·min(s_i A_i, clip(s_i) A_i) with
    w_t = min(exp(old_t − μ_t), cap); its gradient on lp_t is −w_t·A_i·s_i (unclipped branch), else 0."""
    lp, old, mu = x["logprobs"].tolist(), x["proximal_logprobs"].tolist(), x["behavior_logprobs"].tolist()
    adv, mask = x["advantages"].tolist(), x["loss_mask"].tolist()
    loss = [[0.0] * T for _ in range(B)]
    grad = [[0.0] * T for _ in range(B)]
    for i in range(B):
        n = sum(mask[i])
        if n == 0:
            continue
        s = math.exp(min(max(sum(mask[i][t] * (lp[i][t] - old[i][t]) for t in range(T)) / n, -20.0), 20.0))
        a = sum(mask[i][t] * adv[i][t] for t in range(T)) / n
        sc = min(max(s, 1 - eps_low), 1 + eps_high)
        unclipped = s * a <= sc * a
        for t in range(T):
            if mask[i][t]:
                w = min(math.exp(old[i][t] - mu[i][t]), cap)
                loss[i][t] = -w * (s * a if unclipped else sc * a)
                grad[i][t] = -w * a * s if unclipped else 0.0
    return loss, grad


@pytest.mark.parametrize("cap", [1.0, 2.0])
@pytest.mark.parametrize("eps_low,eps_high,spread", [(3e-4, 4e-4, 0.05), (0.1, 0.2, 0.3)])
@pytest.mark.parametrize("seed", [0, 1])
def test_token_behaviour_weight_matches_the_reference(seed, eps_low, eps_high, spread, cap):
    x = inputs(seed, spread)
    lp = x["logprobs"].clone().requires_grad_(True)
    per_token, metrics = get_loss("gspo", eps_low=eps_low, eps_high=eps_high, behavior_weight="token",
                                  weight_cap=cap)(**{**x, "logprobs": lp})
    per_token.sum().backward()
    want_loss, want_grad = token_reference(x, eps_low, eps_high, cap)
    torch.testing.assert_close(per_token.detach(), torch.tensor(want_loss, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lp.grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    m = x["loss_mask"] > 0
    capped = ((x["proximal_logprobs"] - x["behavior_logprobs"]).exp() > cap) & m
    assert metrics["token_is_capped_frac"].item() == pytest.approx(capped.sum().item() / m.sum().item())
    assert cap > 1 or 0 < capped.sum().item() < m.sum().item()  # at cap 1 both sides of the cap are hit


def test_token_form_on_policy_is_gspo():
    """μ = π_prox: every w_t = 1 and GSPO-token's gradient is GSPO's (constant advantages)."""
    x = inputs(4, 0.3)
    x["behavior_logprobs"] = x["proximal_logprobs"].clone()
    grads = []
    for weight in ("token", "none"):
        lp = x["logprobs"].clone().requires_grad_(True)
        per_token, _ = get_loss("gspo", eps_low=0.1, eps_high=0.2, behavior_weight=weight)(**{**x, "logprobs": lp})
        aggregate(per_token, x["loss_mask"], mode="seq_mean_token_mean")[0].backward()
        grads.append(lp.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)
