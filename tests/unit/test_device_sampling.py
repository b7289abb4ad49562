"""The static decoder's tensor sampler (`engines/device_sampling.py`) against a per-row float64 reference
written from SGLang's semantics (the same one `test_sampling_rows.py` uses for the CB sampler): with a
given uniform, the drawn token is the inverse-CDF pick over the truncated distribution in vocabulary
order; the logprob is that of logits / T before truncation; greedy is the argmax; banned ids are never
drawn; the counter hash gives uniforms whose draws match the distribution."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_flash.engines.device_sampling import ban_tokens, sample_device, seed_uniform
from megatron_flash.engines.sampling import SamplingSpec
from tests.unit.test_sampling_rows import LOGITS, SPECS, allowed


def params(specs: list[SamplingSpec], vocab: int) -> dict[str, torch.Tensor]:
    return {
        "temperature": torch.tensor([1.0 if s.greedy else s.temperature for s in specs]),
        "greedy": torch.tensor([s.greedy for s in specs]),
        "top_k": torch.tensor([min(s.top_k, vocab) for s in specs]),
        "top_p": torch.tensor([s.top_p for s in specs]),
        "min_p": torch.tensor([s.min_p for s in specs]),
    }


def inverse_cdf(probs: dict[int, float], vocab: int, u: float) -> int:
    """The token whose cumulative mass (vocabulary order) first reaches (1 - u) of the total."""
    target, mass = (1.0 - u), 0.0
    for token in range(vocab):
        mass += probs.get(token, 0.0)
        if mass >= target - 1e-12 and token in probs:
            return token
    return max(probs)


@pytest.mark.parametrize("u", [0.003, 0.1, 0.37, 0.5, 0.77, 0.95, 0.9999])
def test_token_with_a_given_uniform_matches_the_reference(u: float) -> None:
    vocab = len(LOGITS)
    logits = torch.tensor([LOGITS] * len(SPECS))
    tokens, logprobs = sample_device(logits, **params(SPECS, vocab), uniform=torch.full((len(SPECS),), u,
                                     dtype=torch.float64), truncate=True)
    for i, spec in enumerate(SPECS):
        probs = allowed(LOGITS, spec, [])
        want = max(range(vocab), key=lambda j: LOGITS[j]) if spec.greedy else inverse_cdf(probs, vocab, u)
        assert int(tokens[i]) == want, (i, spec, u)
        t = 1.0 if spec.greedy else spec.temperature
        z = [x / t for x in LOGITS]
        log_norm = max(z) + math.log(sum(math.exp(v - max(z)) for v in z))
        assert float(logprobs[i]) == pytest.approx(z[want] - log_norm, abs=1e-5)


def test_without_truncation_the_same_draw_as_with_truncation_switched_off() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=g)
    specs = [SamplingSpec(temperature=t) for t in (0.5, 1.0, 1.5, 0.8, 1.0)]
    uniform = torch.rand(5, generator=g, dtype=torch.float64)
    plain = sample_device(logits, **params(specs, 300), uniform=uniform, truncate=False)
    full = sample_device(logits, **params(specs, 300), uniform=uniform, truncate=True)
    assert torch.equal(plain[0], full[0])
    torch.testing.assert_close(plain[1], full[1])


def test_hashed_uniforms_are_deterministic_distinct_and_inside_the_open_interval() -> None:
    seeds = torch.tensor([0, 1, 2, (1 << 63) - 1, -5, 1 << 40])
    steps = torch.tensor([0, 0, 0, 7, 3, 1 << 20])
    u = seed_uniform(seeds, steps)
    assert torch.equal(u, seed_uniform(seeds, steps))
    assert bool(((u > 0) & (u < 1)).all())
    assert len(set(u.tolist())) == len(u)
    assert seed_uniform(torch.tensor([9]), torch.tensor([4])).item() != seed_uniform(torch.tensor([9]),
                                                                                     torch.tensor([5])).item()


def test_draws_with_hashed_uniforms_follow_the_truncated_distribution() -> None:
    spec = SamplingSpec(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05)
    vocab, n = len(LOGITS), 20000
    steps = torch.arange(n)
    tokens, _ = sample_device(torch.tensor([LOGITS]).expand(n, vocab), **params([spec] * n, vocab),
                              uniform=seed_uniform(torch.full((n,), 1234), steps), truncate=True)
    want = allowed(LOGITS, spec, [])
    counts = torch.bincount(tokens, minlength=vocab).double() / n
    for token in range(vocab):
        p = want.get(token, 0.0)
        assert abs(float(counts[token]) - p) <= 4 * math.sqrt(max(p * (1 - p), 1e-12) / n) + 1e-9, (token, p)


def test_banned_ids_are_never_drawn_and_padding_changes_nothing() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0], [5.0, 4.0, 0.0, -1.0]])
    ban_ids = torch.tensor([[0, 1, 0], [0, 0, 0]])  # row 0 bans 0 and 1 (padded with 0); row 1 bans nothing
    ban_on = torch.tensor([[True, True, True], [False, False, False]])
    masked = ban_tokens(logits, ban_ids, ban_on)
    assert masked[0, :2].tolist() == [-math.inf, -math.inf] and masked[0, 2:].tolist() == [0.0, -1.0]
    assert torch.equal(masked[1], logits[1])
    spec = [SamplingSpec(temperature=1.0, top_k=1), SamplingSpec(temperature=1.0, top_k=1)]
    tokens, _ = sample_device(masked, **params(spec, 4), uniform=torch.full((2,), 0.5, dtype=torch.float64),
                              truncate=False)
    assert tokens.tolist() == [2, 0]
