"""Per-token losses vs the independent float64 reference (values, gradients, drops, metrics)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loss_reference  # noqa: E402

from megatron_flash.losses import (  # noqa: E402
    LossInputs,
    LossTerms,
    get_loss,
    list_losses,
    loss_param_names,
    register_loss,
)
from megatron_flash.losses import registry  # noqa: E402

B, T = 6, 9
BUILTINS = ["cispo", "decoupled_ppo", "ppo", "reinforce", "tis", "topr"]

CASES = [
    ("ppo", {}),
    ("ppo", {"eps_low": 0.1, "eps_high": 0.3}),
    ("ppo", {"dual_clip": 1.5}),
    ("ppo", {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": 3.0}),
    ("decoupled_ppo", {}),
    ("decoupled_ppo", {"weight_cap": 1.1}),
    ("decoupled_ppo", {"eps_low": 0.15, "eps_high": 0.25, "weight_cap": 0.95}),
    ("tis", {}),
    ("tis", {"lower": 0.8, "upper": 1.2}),
    ("cispo", {}),
    ("cispo", {"eps_low": 0.2, "eps_high": 0.1}),
    ("topr", {}),
    ("topr", {"level": "sequence"}),
    ("reinforce", {}),
    ("ppo", {"mismatch_mask": "token", "mismatch_low": 0.8, "mismatch_high": 1.25}),
    ("tis", {"mismatch_mask": "sequence", "mismatch_low": 0.9, "mismatch_high": 1.1}),
    ("topr", {"level": "sequence", "mismatch_mask": "token", "mismatch_low": 0.8, "mismatch_high": 1.2}),
    ("cispo", {"kl_coef": 0.3, "kl_estimator": "k1"}),
    ("decoupled_ppo", {"weight_cap": 1.2, "kl_coef": 0.5, "kl_estimator": "k3"}),
    ("reinforce", {"kl_coef": 0.1, "mismatch_mask": "token", "mismatch_low": 0.7, "mismatch_high": 1.3}),
]


def make_inputs(seed: int, *, spread: float = 0.4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3 - 0.05
    behavior = logprobs + spread * torch.randn(B, T, generator=gen, dtype=torch.float64)
    proximal = logprobs + spread * torch.randn(B, T, generator=gen, dtype=torch.float64)
    reference = logprobs + spread * torch.randn(B, T, generator=gen, dtype=torch.float64)
    advantages = torch.randn(B, T, generator=gen, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=gen) > 0.25).to(torch.float64)
    mask[-1] = 0.0  # one sequence without response tokens
    rewards = torch.tensor([1.0, 0.0, 0.5, -1.0, 0.0, 1.0], dtype=torch.float64)
    return dict(logprobs=logprobs, behavior_logprobs=behavior, proximal_logprobs=proximal,
                reference_logprobs=reference, advantages=advantages, loss_mask=mask, rewards=rewards)


def run_loss(name: str, params: dict, inputs: dict[str, torch.Tensor]):
    logprobs = inputs["logprobs"].clone().requires_grad_(True)
    loss, metrics = get_loss(name, **params)(**{**inputs, "logprobs": logprobs})
    loss.sum().backward()
    return loss.detach(), logprobs.grad, metrics


def run_reference(name: str, params: dict, inputs: dict[str, torch.Tensor]):
    def lists(key: str):
        value = inputs.get(key)
        return None if value is None else value.tolist()

    return loss_reference.reference_loss(
        name, params, logprobs=lists("logprobs"), behavior=lists("behavior_logprobs"),
        proximal=lists("proximal_logprobs"), advantages=lists("advantages"), mask=lists("loss_mask"),
        rewards=lists("rewards"), reference=lists("reference_logprobs"),
    )


@pytest.mark.parametrize("with_proximal", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("name", "params"), CASES)
def test_values_and_gradients_match_reference(name, params, seed, with_proximal):
    inputs = make_inputs(seed)
    if not with_proximal:
        inputs["proximal_logprobs"] = None
    loss, grad, metrics = run_loss(name, params, inputs)
    ref = run_reference(name, params, inputs)
    torch.testing.assert_close(loss, torch.tensor(ref.loss, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, torch.tensor(ref.grad, dtype=torch.float64), rtol=1e-10, atol=1e-12)

    counts = ref.counts
    num_masked, num_trained = counts["num_masked"], counts["num_trained"]
    assert metrics["num_trained_tokens"].item() == num_trained
    assert metrics["dropped_frac"].item() == pytest.approx((num_masked - num_trained) / num_masked)
    assert metrics["mismatch_dropped_frac"].item() == pytest.approx(counts["mismatch_dropped"] / num_masked)
    if counts["mismatch_dropped"] == 0:
        assert metrics["mismatch_dropped_seq_frac"].item() == 0.0
    assert metrics["loss_dropped_frac"].item() == pytest.approx(counts["cap_dropped"] / num_masked)
    if num_trained:
        assert metrics["is_weight_mean"].item() == pytest.approx(counts["w_mean"], rel=1e-10)
        assert metrics["is_weight_max"].item() == pytest.approx(counts["w_max"], rel=1e-10)
        assert metrics["is_weight_min"].item() == pytest.approx(counts["w_min"], rel=1e-10)
    for key, count in [("clip_frac_low", "clip_low"), ("clip_frac_high", "clip_high"),
                       ("clip_frac_dual", "clip_dual")]:
        if key in metrics:
            assert metrics[key].item() == pytest.approx(counts[count] / max(num_trained, 1)), key
    approx_kl = loss_reference.reference_approx_kl(
        inputs["logprobs"].tolist(), inputs["behavior_logprobs"].tolist(), ref.trained)
    assert metrics["approx_kl"].item() == pytest.approx(approx_kl, rel=1e-10)
    for value in metrics.values():
        assert value.dim() == 0 and not value.requires_grad


def test_cases_exercise_every_branch():
    """The random inputs hit both clip sides and both advantage signs (guards the test's power)."""
    seen: dict[str, float] = {"clip_low": 0, "clip_high": 0, "clip_dual": 0, "cap_dropped": 0,
                              "mismatch_dropped": 0}
    for name, params in CASES:
        for seed in range(3):
            counts = run_reference(name, params, make_inputs(seed)).counts
            for key in seen:
                seen[key] += counts[key]
    assert all(count > 0 for count in seen.values()), seen
    advantages = make_inputs(0)["advantages"]
    assert (advantages > 0).any() and (advantages < 0).any()


@pytest.mark.parametrize("name", BUILTINS)
def test_padding_gets_zero_loss_and_gradient_even_if_non_finite(name):
    inputs = make_inputs(3)
    pad = inputs["loss_mask"] == 0
    for key in ("logprobs", "behavior_logprobs", "proximal_logprobs", "reference_logprobs", "advantages"):
        inputs[key] = inputs[key].masked_fill(pad, float("nan") if key == "advantages" else -math.inf)
    loss, grad, metrics = run_loss(name, {"kl_coef": 0.1, "mismatch_mask": "token"}, inputs)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    assert (loss[pad] == 0).all() and (grad[pad] == 0).all()
    assert all(torch.isfinite(value) for value in metrics.values())


@pytest.mark.parametrize("extreme", [100.0, -100.0])
@pytest.mark.parametrize("name", BUILTINS)
def test_extreme_log_ratios_stay_finite(name, extreme):
    inputs = make_inputs(4)
    inputs["behavior_logprobs"] = inputs["logprobs"] - extreme
    inputs["proximal_logprobs"] = inputs["logprobs"] + extreme
    inputs["reference_logprobs"] = inputs["logprobs"] + extreme
    params = {"kl_coef": 0.1}
    loss, grad, metrics = run_loss(name, params, inputs)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    assert all(torch.isfinite(value) for value in metrics.values())
    ref = run_reference(name, params, inputs)
    torch.testing.assert_close(grad, torch.tensor(ref.grad, dtype=torch.float64), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_topr_positive_sequences_ignore_behavior_policy(level):
    inputs = make_inputs(5)
    loss_fn = get_loss("topr", level=level)
    positive = inputs["rewards"] > 0
    grads = []
    for shift in (0.0, 3.0, -3.0):
        logprobs = inputs["logprobs"].clone().requires_grad_(True)
        shifted = {**inputs, "logprobs": logprobs, "behavior_logprobs": inputs["behavior_logprobs"] + shift}
        loss_fn(**shifted)[0].sum().backward()
        grads.append(logprobs.grad)
    mask = inputs["loss_mask"] != 0
    expected = torch.where(mask, -inputs["advantages"], torch.zeros_like(mask, dtype=torch.float64))
    for grad in grads:
        torch.testing.assert_close(grad[positive], expected[positive], rtol=0, atol=0)
    # Negative sequences do depend on μ: a big shift of log μ changes their weights.
    assert not torch.allclose(grads[0][~positive], grads[1][~positive])


def test_topr_sequence_level_weight_is_shared_by_the_sequence():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    behavior = torch.tensor([[-0.5, -1.5, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    advantages = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
    loss, _ = get_loss("topr", level="sequence")(
        logprobs=logprobs, behavior_logprobs=behavior, advantages=advantages, loss_mask=mask,
        rewards=torch.tensor([0.0], dtype=torch.float64))
    loss.sum().backward()
    rho = math.exp(-0.5 - 0.5)  # masked third token excluded
    expected = torch.tensor([[rho * 1.0, rho * 2.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logprobs.grad, expected, rtol=1e-12, atol=0)


def test_topr_requires_rewards():
    inputs = make_inputs(0)
    inputs.pop("rewards")
    with pytest.raises(ValueError, match="rewards"):
        get_loss("topr")(**inputs)


def test_decoupled_ppo_cap_drops_and_counts_tokens():
    logprobs = torch.full((1, 4), -1.0, dtype=torch.float64, requires_grad=True)
    behavior = torch.full((1, 4), -1.0, dtype=torch.float64)
    # π_prox/μ = e^0, e^0.5, e^1, e^-1 → cap 1.5 drops tokens 2 and 3 (e^0.5≈1.65, e^1≈2.72)
    proximal = behavior + torch.tensor([[0.0, 0.5, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    advantages = torch.ones(1, 4, dtype=torch.float64)
    loss, metrics = get_loss("decoupled_ppo", weight_cap=1.5)(
        logprobs=logprobs, behavior_logprobs=behavior, proximal_logprobs=proximal,
        advantages=advantages, loss_mask=mask)
    assert loss[0, 1] == 0 and loss[0, 2] == 0 and loss[0, 0] != 0 and loss[0, 3] != 0
    assert metrics["loss_dropped_frac"].item() == pytest.approx(0.5)
    assert metrics["dropped_frac"].item() == pytest.approx(0.5)
    assert metrics["num_trained_tokens"].item() == 2
    assert metrics["is_weight_max"].item() == pytest.approx(1.0)
    assert metrics["is_weight_min"].item() == pytest.approx(math.exp(-1.0))


@pytest.mark.parametrize(("mode", "expected_kept"), [
    # ratios π_prox/μ: row 0 = [1, 3, 1, 0.4] (pad last); row 1 = [1.2, 1.2, 1.2]; row 2 = [3, 1/3, 1]
    ("token", [[True, False, True, False], [True, True, True, False], [False, False, True, False]]),
    # geometric means with range [0.9, 1.3]: row 0 = 3^(1/3) ≈ 1.44 dropped, row 1 = 1.2, row 2 = 1 kept
    ("sequence", [[False, False, False, False], [True, True, True, False], [True, True, True, False]]),
])
def test_mismatch_mask_drops_the_right_tokens(mode, expected_kept):
    log_ratios = torch.log(torch.tensor(
        [[1.0, 3.0, 1.0, 0.4], [1.2, 1.2, 1.2, 1.0], [3.0, 1 / 3, 1.0, 1.0]], dtype=torch.float64))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)
    behavior = torch.full((3, 4), -1.0, dtype=torch.float64)
    logprobs = behavior.clone().requires_grad_(True)
    params = {"mismatch_mask": mode, "mismatch_low": 0.9, "mismatch_high": 1.3}
    loss_fn = get_loss("reinforce", **params)
    assert loss_fn.needs_proximal
    loss, metrics = loss_fn(
        logprobs=logprobs, behavior_logprobs=behavior, proximal_logprobs=behavior + log_ratios,
        advantages=torch.ones(3, 4, dtype=torch.float64), loss_mask=mask)
    kept = torch.tensor(expected_kept)
    assert ((loss != 0) == kept).all()
    num_dropped = int(mask.sum() - kept.sum())
    assert metrics["mismatch_dropped_frac"].item() == pytest.approx(num_dropped / 9)
    # sequences that lost a token: token mode rows 0 and 2, sequence mode row 0 (of 3)
    assert metrics["mismatch_dropped_seq_frac"].item() == pytest.approx((2 if mode == "token" else 1) / 3)
    # Without proximal logprobs there is nothing to compare: nothing dropped.
    loss, metrics = loss_fn(logprobs=logprobs, behavior_logprobs=behavior,
                            advantages=torch.ones(3, 4, dtype=torch.float64), loss_mask=mask)
    assert ((loss != 0) == mask).all() and metrics["dropped_frac"].item() == 0


@pytest.mark.parametrize(("estimator", "expected_kl", "expected_grad"), [
    # Δ = log π_ref − log π_θ = 0.5 and −1.0
    ("k1", [-0.5, 1.0], [1.0, 1.0]),
    ("k3", [math.exp(0.5) - 1.5, math.exp(-1.0)], [1.0 - math.exp(0.5), 1.0 - math.exp(-1.0)]),
])
def test_kl_term_values_and_gradients(estimator, expected_kl, expected_grad):
    logprobs = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    reference = torch.tensor([[-0.5, -3.0]], dtype=torch.float64)
    loss_fn = get_loss("reinforce", kl_coef=0.25, kl_estimator=estimator)
    assert loss_fn.needs_reference
    zeros = torch.zeros(1, 2, dtype=torch.float64)
    loss, metrics = loss_fn(logprobs=logprobs, behavior_logprobs=logprobs.detach(), advantages=zeros,
                            loss_mask=torch.ones(1, 2), reference_logprobs=reference)
    loss.sum().backward()
    torch.testing.assert_close(loss.detach(), 0.25 * torch.tensor([expected_kl], dtype=torch.float64))
    torch.testing.assert_close(logprobs.grad, 0.25 * torch.tensor([expected_grad], dtype=torch.float64))
    assert metrics["kl_ref"].item() == pytest.approx(sum(expected_kl) / 2)
    # No reference logprobs: no KL term, no kl_ref metric.
    loss, metrics = loss_fn(logprobs=logprobs, behavior_logprobs=logprobs.detach(), advantages=zeros,
                            loss_mask=torch.ones(1, 2))
    assert (loss == 0).all() and "kl_ref" not in metrics


def test_ppo_dual_clip_hand_example():
    # r = e^1 ≈ 2.718 > c = 2, A = −1: standard PPO loss r·|A| ≈ 2.718, dual clip caps it at 2.
    logprobs = torch.tensor([[0.0]], dtype=torch.float64, requires_grad=True)
    args = dict(behavior_logprobs=torch.tensor([[-1.0]], dtype=torch.float64),
                advantages=torch.tensor([[-1.0]], dtype=torch.float64), loss_mask=torch.ones(1, 1))
    plain, _ = get_loss("ppo")(logprobs=logprobs, **args)
    dual, metrics = get_loss("ppo", dual_clip=2.0)(logprobs=logprobs, **args)
    assert plain.item() == pytest.approx(math.e)
    assert dual.item() == pytest.approx(2.0) and metrics["clip_frac_dual"].item() == 1.0
    (grad,) = torch.autograd.grad(dual.sum(), logprobs)
    assert grad.item() == 0.0


def test_needs_proximal_flags():
    flags = {name: get_loss(name).needs_proximal for name in BUILTINS}
    assert flags == {"cispo": False, "decoupled_ppo": True, "ppo": True, "reinforce": False,
                     "tis": False, "topr": False}
    assert get_loss("tis", mismatch_mask="sequence").needs_proximal
    assert not get_loss("ppo").needs_reference and get_loss("ppo", kl_coef=0.1).needs_reference


def test_unknown_loss_lists_known_names():
    with pytest.raises(ValueError, match="unknown loss 'pp0'") as info:
        get_loss("pp0")
    for name in BUILTINS:
        assert name in str(info.value)
    assert set(BUILTINS) <= set(list_losses())
    with pytest.raises(ValueError, match="known losses"):
        loss_param_names("nope")


@pytest.mark.parametrize(("name", "params", "pattern"), [
    ("ppo", {"weight_cp": 1.0},
     r"loss 'ppo' got unknown parameter 'weight_cp'; accepted: eps_low, eps_high, dual_clip"),
    ("ppo", {"eps_low": 1.0}, r"loss 'ppo' parameter 'eps_low' must be in \[0, 1\), got 1.0"),
    ("ppo", {"eps_high": -0.1}, "'eps_high'.*-0.1"),
    ("ppo", {"dual_clip": 1.0}, "'dual_clip'.*1.0"),
    ("ppo", {"eps_low": "0.2"}, "'eps_low' must be a finite number, got '0.2'"),
    ("decoupled_ppo", {"weight_cap": 0}, "'weight_cap'.*got 0"),
    ("tis", {"lower": 1.5, "upper": 1.0}, "'upper'.*got 1.0"),
    ("tis", {"upper": float("nan")}, "'upper'"),
    ("cispo", {"eps_low": 1.5}, "'eps_low'.*1.5"),
    ("topr", {"level": "batch"}, "loss 'topr' parameter 'level' must be one of token, sequence; got 'batch'"),
    ("reinforce", {"eps_low": 0.2}, "loss 'reinforce' got unknown parameter 'eps_low'"),
    ("tis", {"mismatch_mask": "tokens"}, "loss 'tis' parameter 'mismatch_mask'.*'tokens'"),
    ("tis", {"mismatch_low": 0.0}, "'mismatch_low'.*got 0.0"),
    ("tis", {"mismatch_low": 1.5, "mismatch_high": 1.2}, "'mismatch_high'.*1.2"),
    ("tis", {"kl_coef": -1.0}, "'kl_coef'.*-1.0"),
    ("tis", {"kl_estimator": "k2"}, "'kl_estimator'.*'k2'"),
])
def test_bad_params_raise_naming_loss_and_param(name, params, pattern):
    with pytest.raises(ValueError, match=pattern):
        get_loss(name, **params)


def test_loss_param_names():
    common = {"mismatch_mask", "mismatch_low", "mismatch_high", "kl_coef", "kl_estimator"}
    assert loss_param_names("ppo") == {"eps_low", "eps_high", "dual_clip"} | common
    assert loss_param_names("decoupled_ppo") == {"eps_low", "eps_high", "weight_cap"} | common
    assert loss_param_names("tis") == {"lower", "upper"} | common
    assert loss_param_names("cispo") == {"eps_low", "eps_high"} | common
    assert loss_param_names("topr") == {"level"} | common
    assert loss_param_names("reinforce") == common


def test_shape_errors_name_the_tensor():
    inputs = make_inputs(0)
    inputs["advantages"] = inputs["advantages"][:, :-1]
    with pytest.raises(ValueError, match="advantages"):
        get_loss("ppo")(**inputs)
    inputs = make_inputs(0)
    inputs["rewards"] = inputs["rewards"][:-1]
    with pytest.raises(ValueError, match="rewards"):
        get_loss("topr")(**inputs)


def test_register_user_loss_gets_common_params_and_duplicate_raises():
    name = "test_scaled_reinforce"
    try:
        @register_loss(name, needs_proximal=True)
        def scaled(*, scale: float = 1.0):
            def fn(batch: LossInputs) -> LossTerms:
                keep = batch.advantages > -10.0  # keeps all; exercises the keep path
                loss = -scale * batch.advantages * batch.logprobs
                return LossTerms(loss, {"scale": torch.tensor(scale)}, keep)
            return fn

        assert name in list_losses()
        assert loss_param_names(name) >= {"scale", "kl_coef", "mismatch_mask"}
        loss_fn = get_loss(name, scale=2.0, kl_coef=0.1, kl_estimator="k1")
        assert loss_fn.needs_proximal
        inputs = make_inputs(6)
        loss, grad, metrics = run_loss(name, {"scale": 2.0, "kl_coef": 0.1, "kl_estimator": "k1"}, inputs)
        mask = inputs["loss_mask"] != 0
        expected = torch.where(mask, -2.0 * inputs["advantages"] + 0.1, torch.zeros_like(grad))
        torch.testing.assert_close(grad, expected)
        assert metrics["scale"].item() == 2.0 and "kl_ref" in metrics
        with pytest.raises(ValueError, match=f"loss '{name}' got unknown parameter 'scal'"):
            get_loss(name, scal=1.0)
        with pytest.raises(ValueError, match="already registered"):
            register_loss(name)(scaled)
        with pytest.raises(ValueError, match="already registered"):
            register_loss("ppo")(scaled)
    finally:
        registry._REGISTRY.pop(name, None)


def test_register_rejects_bad_factories():
    with pytest.raises(ValueError, match="'kwargs'"):
        register_loss("test_bad_kwargs")(lambda **kwargs: None)
    with pytest.raises(ValueError, match="'kl_coef'.*clashes"):
        register_loss("test_bad_clash")(lambda *, kl_coef=0.0: None)
    with pytest.raises(ValueError, match="non-empty string"):
        register_loss("")
    assert "test_bad_kwargs" not in list_losses() and "test_bad_clash" not in list_losses()


def test_user_loss_with_required_param():
    name = "test_required_param"
    try:
        @register_loss(name)
        def needs_beta(*, beta: float):
            return lambda batch: LossTerms(-beta * batch.advantages * batch.logprobs, {})

        with pytest.raises(ValueError, match=f"loss '{name}' requires parameter 'beta'"):
            get_loss(name)
        assert get_loss(name, beta=0.5).params["beta"] == 0.5
    finally:
        registry._REGISTRY.pop(name, None)


def test_bool_mask_equals_float_mask():
    inputs = make_inputs(7)
    loss_f, grad_f, _ = run_loss("ppo", {}, inputs)
    loss_b, grad_b, _ = run_loss("ppo", {}, {**inputs, "loss_mask": inputs["loss_mask"] != 0})
    torch.testing.assert_close(loss_f, loss_b, rtol=0, atol=0)
    torch.testing.assert_close(grad_f, grad_b, rtol=0, atol=0)


@pytest.mark.parametrize("name", BUILTINS)
def test_batch_without_trained_tokens(name):
    inputs = make_inputs(8)
    inputs["loss_mask"] = torch.zeros(B, T, dtype=torch.float64)
    loss, grad, metrics = run_loss(name, {"kl_coef": 0.1, "mismatch_mask": "sequence"}, inputs)
    assert (loss == 0).all() and (grad == 0).all()
    assert all(value.item() == 0 for value in metrics.values())


def test_class_factory_and_docs_example_run():
    class HalfReinforce:
        def __init__(self, *, half: float = 0.5) -> None:
            self.half = half

        def __call__(self, batch: LossInputs) -> LossTerms:
            return LossTerms(-self.half * batch.advantages * batch.logprobs, {})

    docs = Path(__file__).resolve().parents[2] / "docs" / "losses.md"
    example = docs.read_text().split("## Registering your own loss")[1].split("```python")[1].split("```")[0]
    try:
        register_loss("test_half_reinforce")(HalfReinforce)
        assert loss_param_names("test_half_reinforce") >= {"half"}
        _, grad, _ = run_loss("test_half_reinforce", {"half": 0.25}, make_inputs(9))
        inputs = make_inputs(9)
        torch.testing.assert_close(grad, -0.25 * inputs["advantages"] * (inputs["loss_mask"] != 0))
        namespace: dict = {}
        exec(compile(example, str(docs), "exec"), namespace)
        _, grad, metrics = run_loss("clipped_reinforce", {"max_weight": 1.5}, inputs)
        assert torch.isfinite(grad).all() and "clip_frac_high" in metrics
    finally:
        registry._REGISTRY.pop("test_half_reinforce", None)
        registry._REGISTRY.pop("clipped_reinforce", None)
