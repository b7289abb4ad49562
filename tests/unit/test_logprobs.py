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


from megatron_flash.trainer.logprobs import vocab_parallel_logprobs_reference  # noqa: E402


@pytest.mark.parametrize("chunk_tokens", [1, 3, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_the_whole_tensor_version(chunk_tokens: int, temperature: float) -> None:
    """Values and gradients (through logprobs and entropy at once) of the chunked function against the
    whole-tensor reference: fp32, a padded vocabulary, a non-contiguous view as the trainer passes it."""
    g = torch.Generator().manual_seed(3)
    vocab, padded = 37, 40
    full = (torch.randn(2, 9, padded, generator=g) * 4).requires_grad_()
    targets = torch.randint(0, vocab, (2, 8), generator=g)
    w_lp, w_ent = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    grads, values = [], []
    for fn, kw in ((vocab_parallel_logprobs_reference, {}),
                   (vocab_parallel_logprobs, {"chunk_elements": chunk_tokens * padded})):
        full.grad = None
        lp, ent = fn(full[:, :-1], targets, vocab_size=vocab, temperature=temperature, with_entropy=True, **kw)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        values.append((lp.detach(), ent.detach()))
        grads.append(full.grad.clone())
    assert torch.allclose(values[1][0], values[0][0], atol=1e-6, rtol=0)
    assert torch.allclose(values[1][1], values[0][1], atol=1e-6, rtol=0)
    assert torch.allclose(grads[1], grads[0], atol=1e-6, rtol=0)
    assert grads[1][:, :, vocab:].abs().max() == 0 and grads[1][:, -1].abs().max() == 0


def test_chunked_logprobs_alone_and_without_grad() -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(1, 5, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 8, (1, 5), generator=g)
    lp, ent = vocab_parallel_logprobs(logits, targets, vocab_size=8, chunk_elements=16)
    assert ent is None
    lp.sum().backward()
    p = torch.softmax(logits.detach(), -1)
    expected = -p
    expected.scatter_add_(-1, targets.unsqueeze(-1), torch.ones(1, 5, 1))
    assert torch.allclose(logits.grad, expected, atol=1e-6)
    with torch.no_grad():
        lp2, _ = vocab_parallel_logprobs(logits, targets, vocab_size=8)
    assert torch.allclose(lp2, torch.log_softmax(logits.detach(), -1).gather(-1, targets.unsqueeze(-1))[..., 0],
                          atol=1e-6)
