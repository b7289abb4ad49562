"""vocab_parallel_logprobs at TP=1 against a float64 log-softmax written out directly."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_flash.trainer.logprobs import vocab_parallel_logprobs


def reference(logits: torch.Tensor, targets: torch.Tensor, vocab: int, temperature: float):
    b, s, _ = logits.shape
    lp = torch.zeros(b, s, dtype=torch.float64)
    ent = torch.zeros(b, s, dtype=torch.float64)
    for i in range(b):
        for t in range(s):
            z = [float(x) / temperature for x in logits[i, t, :vocab]]
            m = max(z)
            lse = m + math.log(sum(math.exp(x - m) for x in z))
            lp[i, t] = z[int(targets[i, t])] - lse
            ent[i, t] = -sum(math.exp(x - lse) * (x - lse) for x in z)
    return lp, ent


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_reference_and_ignores_vocab_padding(temperature: float) -> None:
    g = torch.Generator().manual_seed(0)
    vocab, padded = 11, 16
    logits = torch.randn(2, 5, padded, generator=g, dtype=torch.float64) * 3
    logits[..., vocab:] = 50.0  # padding rows must not take any probability mass
    targets = torch.randint(0, vocab, (2, 5), generator=g)
    lp, ent = vocab_parallel_logprobs(logits, targets, vocab_size=vocab, temperature=temperature, with_entropy=True)
    ref_lp, ref_ent = reference(logits, targets, vocab, temperature)
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5)
    assert torch.allclose(ent.double(), ref_ent, atol=1e-5)


def test_gradient_is_onehot_minus_softmax() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 1, 6, generator=g, requires_grad=True)
    target = torch.tensor([[2]])
    lp, _ = vocab_parallel_logprobs(logits, target, vocab_size=6)
    lp.sum().backward()
    p = torch.softmax(logits.detach()[0, 0].double(), -1)
    expected = -p
    expected[2] += 1
    assert torch.allclose(logits.grad[0, 0].double(), expected, atol=1e-6)


def test_rejects_non_positive_temperature() -> None:
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(torch.zeros(1, 1, 3), torch.zeros(1, 1, dtype=torch.long), vocab_size=3, temperature=0)
