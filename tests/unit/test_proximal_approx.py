"""loss.prox_logprobs=approximate: π_prox from the training forward (exact on a step's first optimizer
step) and the log-linear interpolation on later ones, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_flash.config import load_config
from megatron_flash.losses import get_loss
from megatron_flash.losses.proximal import approximate_proximal
from megatron_flash.recipes import behavior_lags
from megatron_flash.trainer.loss_adapter import build_loss_fn, make_loss_fn
from megatron_flash.types import Sample, TrainBatch


def test_first_optimizer_step_takes_the_forward_itself() -> None:
    lp = torch.tensor([[-0.5, -1.25, -2.0]], requires_grad=True)
    got = approximate_proximal(logprobs=lp, behavior_logprobs=torch.tensor([[-0.1, -0.2, -0.3]]),
                               behavior_lag=torch.tensor([[0.0, 2.0, 5.0]]), theta_advance=0.0)
    assert not got.requires_grad
    assert got.tolist() == [[-0.5, -1.25, -2.0]]


def test_later_steps_interpolate_by_version_gap() -> None:
    lp = torch.tensor([[-0.5, -1.25, -2.0, -0.7]], dtype=torch.float64)
    mu = torch.tensor([[-0.1, -0.2, -0.3, -0.9]], dtype=torch.float64)
    lag = torch.tensor([[0.0, 1.0, 2.0, 3.0]], dtype=torch.float64)
    got = approximate_proximal(logprobs=lp, behavior_logprobs=mu, behavior_lag=lag, theta_advance=0.5)
    # w = g / (g + 1/2): 0, 2/3, 4/5, 6/7 (worked by hand)
    want = [-0.1, -0.2 + (2 / 3) * (-1.25 + 0.2), -0.3 + 0.8 * (-2.0 + 0.3), -0.9 + (6 / 7) * (-0.7 + 0.9)]
    assert got[0].tolist() == pytest.approx(want, abs=1e-12)
    with pytest.raises(ValueError, match="theta_advance"):
        approximate_proximal(logprobs=lp, behavior_logprobs=mu, behavior_lag=lag, theta_advance=1.0)


def _micro(lag: torch.Tensor) -> TrainBatch:
    gen = torch.Generator().manual_seed(3)
    b, t = lag.shape
    mask = torch.ones(b, t)
    mask[1, 4:] = 0
    return TrainBatch(tokens=torch.zeros(b, t, dtype=torch.long), loss_mask=mask,
                      behavior_logprobs=-torch.rand(b, t, generator=gen) * mask,
                      advantages=torch.randn(b, t, generator=gen) * mask, behavior_lag=lag * mask)


def test_one_step_approximation_equals_a_recomputed_prox_in_loss_and_gradient() -> None:
    """One optimizer step per batch: the recompute forward gives log π_θ's own values, so both paths
    must give the same loss and gradient for a loss that reads π_prox."""
    mb = _micro(torch.tensor([[0.0] * 6, [2.0] * 6]))
    logits = torch.randn(2, 6, generator=torch.Generator().manual_seed(5)) - 1.0
    loss = get_loss("decoupled_ppo")
    approx = make_loss_fn(loss, approximate_prox=True)
    recompute = make_loss_fn(loss)
    lp_a = logits.clone().requires_grad_(True)
    lp_r = logits.clone().requires_grad_(True)
    sum_a, den_a, _ = approx(mb, lp_a, None)
    sum_r, den_r, _ = recompute(mb.replace(proximal_logprobs=logits.clone() * mb.loss_mask), lp_r, None)
    sum_a.backward()
    sum_r.backward()
    assert float(sum_a) == pytest.approx(float(sum_r), abs=1e-7) and int(den_a) == int(den_r)
    assert torch.allclose(lp_a.grad, lp_r.grad, atol=1e-7)
    assert lp_a.grad.abs().sum() > 0  # not vacuous


def test_later_step_uses_the_interpolated_prox() -> None:
    mb = _micro(torch.tensor([[1.0] * 6, [3.0] * 6]))
    logits = mb.behavior_logprobs - 1.5  # far enough from μ that PPO's clip binds against some π_prox
    loss = get_loss("decoupled_ppo")
    fn = make_loss_fn(loss, approximate_prox=True)
    fn.theta_advance = 0.75
    prox = approximate_proximal(logprobs=logits, behavior_logprobs=mb.behavior_logprobs,
                                behavior_lag=mb.behavior_lag, theta_advance=0.75)

    def grad(loss_fn, batch):
        lp = logits.clone().requires_grad_(True)
        loss_fn(batch, lp, None)[0].backward()
        return lp.grad

    got = grad(fn, mb)
    assert torch.allclose(got, grad(make_loss_fn(loss), mb.replace(proximal_logprobs=prox)), atol=1e-7)
    on_theta = grad(make_loss_fn(loss), mb.replace(proximal_logprobs=logits.clone()))
    assert (got - on_theta).abs().max() > 1e-3  # the interpolated π_prox clipped other tokens


def test_behavior_lags_follow_the_token_labels() -> None:
    a = Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], behavior_logprobs=[-1.0] * 3, version_start=5,
               version_end=6, token_versions=[5, 6, -1])
    b = Sample(prompt_ids=[1], response_ids=[7, 8], behavior_logprobs=[-1.0] * 2, version_start=7, version_end=7)
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.float32)
    got = behavior_lags([a, b], 7, mask)
    # a: labels 5, 6, unknown (→ its start, 5) at version 7; b: every token at 7
    assert got.tolist() == [[0, 0, 2, 1, 2], [0, 0, 0, 0, 0]]


def test_approximate_is_refused_for_a_loss_without_prox() -> None:
    cfg = load_config(None, ["loss.name=tis", "loss.prox_logprobs=approximate"])
    with pytest.raises(ValueError, match="loss.prox_logprobs=approximate"):
        build_loss_fn(cfg.loss)
    with pytest.raises(ValueError, match="prox_logprobs"):
        load_config(None, ["loss.prox_logprobs=guess"])
    ok = load_config(None, ["loss.name=decoupled_ppo", "loss.prox_logprobs=approximate"])
    assert build_loss_fn(ok.loss)[1].approximate_prox
