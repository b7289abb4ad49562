"""Aggregation: hand values, and the same gradient for any micro-batch / DP split.

Megatron (calculate_per_token_loss=True) sums loss_sum and the denominator over micro-batches and
DP ranks and divides the gradient by the total denominator; the splits below mimic that:

    split   micro-batches × sequences each
    1×8     one micro-batch (the full batch)
    2×4     two micro-batches, or DP=2 with one micro-batch each
    4×2     DP=2 × two micro-batches
    8×1     eight micro-batches of one sequence
"""

from __future__ import annotations

import pytest
import torch

from megatron_flash.losses import AGGREGATION_MODES, aggregate, get_loss

NUM_SEQS, NUM_POS = 8, 7


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(NUM_SEQS, NUM_POS, generator=gen, dtype=torch.float64) * 2 - 0.1
    lengths = torch.tensor([1, 7, 3, 0, 5, 2, 6, 4])  # very different lengths, one empty sequence
    mask = torch.arange(NUM_POS).unsqueeze(0) < lengths.unsqueeze(1)
    return dict(
        logprobs=logprobs,
        behavior_logprobs=logprobs + 0.3 * torch.randn(NUM_SEQS, NUM_POS, generator=gen, dtype=torch.float64),
        advantages=torch.randn(NUM_SEQS, 1, generator=gen, dtype=torch.float64).expand(NUM_SEQS, NUM_POS),
        loss_mask=mask,
    )


NORM = 5.0  # the constant of seq_mean_token_sum_norm


def norm_of(mode: str) -> float | None:
    return NORM if mode == "seq_mean_token_sum_norm" else None


def split_gradient(inputs: dict[str, torch.Tensor], *, mode: str, seqs_per_micro: int,
                   loss_name: str = "ppo") -> torch.Tensor:
    loss_fn = get_loss(loss_name)
    logprobs = inputs["logprobs"].clone().requires_grad_(True)
    loss_sums, denominators = [], []
    for start in range(0, NUM_SEQS, seqs_per_micro):
        rows = slice(start, start + seqs_per_micro)
        micro = {key: value[rows] for key, value in inputs.items()}
        per_token, _ = loss_fn(**{**micro, "logprobs": logprobs[rows]})
        loss_sum, denominator = aggregate(per_token, micro["loss_mask"], mode=mode, norm=norm_of(mode))
        loss_sums.append(loss_sum)
        denominators.append(denominator)
    total = torch.stack(loss_sums).sum() / torch.stack(denominators).sum()
    total.backward()
    return logprobs.grad


@pytest.mark.parametrize("loss_name", ["ppo", "gspo"])
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_gradient_is_split_invariant(mode, loss_name):
    inputs = batch()
    full = split_gradient(inputs, mode=mode, seqs_per_micro=8, loss_name=loss_name)
    assert full.abs().sum() > 0
    for seqs_per_micro in (4, 2, 1):
        torch.testing.assert_close(split_gradient(inputs, mode=mode, seqs_per_micro=seqs_per_micro,
                                                  loss_name=loss_name), full, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_full_objective_matches_a_float64_loop(mode):
    """The global objective Megatron minimises, Σ loss_sum / Σ denominator, against plain loops."""
    inputs = batch(1)
    per_token, _ = get_loss("reinforce")(**inputs)  # per-token loss −A·lp: values easy to recompute
    loss_sum, denominator = aggregate(per_token, inputs["loss_mask"], mode=mode, norm=norm_of(mode))
    lp, adv, mask = inputs["logprobs"].tolist(), inputs["advantages"].tolist(), inputs["loss_mask"].tolist()
    seqs = [[-adv[b][t] * lp[b][t] for t in range(NUM_POS) if mask[b][t]] for b in range(NUM_SEQS)]
    seqs = [row for row in seqs if row]
    want = {"token_mean": sum(map(sum, seqs)) / sum(map(len, seqs)),
            "seq_mean_token_mean": sum(sum(r) / len(r) for r in seqs) / len(seqs),
            "seq_mean_token_sum": sum(sum(r) for r in seqs) / len(seqs),
            "seq_mean_token_sum_norm": sum(sum(r) / NORM for r in seqs) / len(seqs)}[mode]
    assert (loss_sum / denominator).item() == pytest.approx(want, rel=1e-12)
    # and its gradient w.r.t. each trained token's loss, from the same loops: 1/T (token_mean),
    # 1/(S·n_b) (seq_mean_token_mean), 1/S (token_sum), 1/(S·C) (token_sum_norm); 0 off the mask
    leaf = per_token.detach().clone().requires_grad_(True)
    s_, d_ = aggregate(leaf, inputs["loss_mask"], mode=mode, norm=norm_of(mode))
    (s_ / d_).backward()
    n_tok, n_seq = sum(map(len, seqs)), len(seqs)
    lengths = [sum(1 for t in range(NUM_POS) if mask[b][t]) for b in range(NUM_SEQS)]
    for b in range(NUM_SEQS):
        for t in range(NUM_POS):
            expected = 0.0 if not mask[b][t] else {
                "token_mean": 1 / n_tok, "seq_mean_token_mean": 1 / (n_seq * max(lengths[b], 1)),
                "seq_mean_token_sum": 1 / n_seq, "seq_mean_token_sum_norm": 1 / (n_seq * NORM)}[mode]
            assert leaf.grad[b, t].item() == pytest.approx(expected, rel=1e-12, abs=1e-15), (b, t)


def test_token_sum_modes_refuse_a_missing_or_stray_norm():
    per_token, mask = torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="norm is required"):
        aggregate(per_token, mask, mode="seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="norm is only for seq_mean_token_sum_norm"):
        aggregate(per_token, mask, mode="token_mean", norm=4.0)
    with pytest.raises(ValueError, match="norm must be > 0"):
        aggregate(per_token, mask, mode="seq_mean_token_sum_norm", norm=0.0)


def test_naive_mean_of_means_is_not_invariant():
    """Guards the test's power: averaging per-micro-batch token means gives a different gradient."""
    inputs = batch()
    loss_fn = get_loss("ppo")
    logprobs = inputs["logprobs"].clone().requires_grad_(True)
    means = []
    for start in range(0, NUM_SEQS, 2):
        rows = slice(start, start + 2)
        micro = {key: value[rows] for key, value in inputs.items()}
        per_token, _ = loss_fn(**{**micro, "logprobs": logprobs[rows]})
        loss_sum, denominator = aggregate(per_token, micro["loss_mask"], mode="token_mean")
        means.append(loss_sum / denominator.clamp(min=1))
    torch.stack(means).mean().backward()
    assert not torch.allclose(logprobs.grad, split_gradient(inputs, mode="token_mean", seqs_per_micro=8))


def test_hand_values():
    # sequence 0: losses [1, 3] (2 tokens); sequence 1: [4] + a padded 100; sequence 2: no tokens
    per_token = torch.tensor([[1.0, 3.0, 0.0], [4.0, 100.0, 0.0], [7.0, 7.0, 7.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.float32)
    loss_sum, denominator = aggregate(per_token, mask, mode="token_mean")
    assert loss_sum.item() == 8.0 and denominator.item() == 3 and denominator.dtype == torch.int32
    loss_sum, denominator = aggregate(per_token, mask, mode="seq_mean_token_mean")
    assert loss_sum.item() == 2.0 + 4.0 and denominator.item() == 2
    loss_sum.backward()
    expected = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(per_token.grad, expected, rtol=0, atol=0)
    assert loss_sum.dim() == 0 and denominator.dim() == 0 and not denominator.requires_grad


def test_default_mode_is_token_mean_and_bad_inputs_raise():
    per_token = torch.ones(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    assert aggregate(per_token, mask)[1].item() == 6
    message = ("unknown aggregation mode 'seq_mean'; known: token_mean, seq_mean_token_mean, seq_mean_token_sum, "
               "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match=message):
        aggregate(per_token, mask, mode="seq_mean")
    with pytest.raises(ValueError, match="same"):
        aggregate(per_token, mask[:1])
