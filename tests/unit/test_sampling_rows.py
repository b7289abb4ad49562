"""The local engine's batched sampler (`engines/sampling.sample_rows`) against a per-row float64 reference
written from SGLang's semantics: logprobs of logits / T before truncation, greedy = argmax, top-k (ties
with the k-th kept) → top-p → min-p, banned ids never drawn, a seed reproduces its tokens, and the
frequencies of many draws match the truncated distribution."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_flash.engines.sampling import TOP_K_ALL, SamplingSpec, sample_rows


def allowed(logits: list[float], spec: SamplingSpec, banned: list[int]) -> dict[int, float]:
    """token → probability (normalized) of what the spec may draw, per SGLang's order of truncations."""
    z = [(-math.inf if i in banned else x) / spec.temperature for i, x in enumerate(logits)]
    top = max(z)
    p = [math.exp(v - top) for v in z]
    total = sum(p)
    p = [v / total for v in p]
    if spec.top_k < len(p):
        kth = sorted(p, reverse=True)[spec.top_k - 1]
        p = [0.0 if v < kth else v for v in p]
    if spec.top_p < 1.0:
        mass, before = sum(p), 0.0
        for i in sorted(range(len(p)), key=lambda i: -p[i]):
            keep = before <= spec.top_p * mass
            before += p[i]
            if not keep:
                p[i] = 0.0
    if spec.min_p > 0.0:
        floor = spec.min_p * max(p)
        p = [0.0 if v < floor else v for v in p]
    total = sum(p)
    return {i: v / total for i, v in enumerate(p) if v > 0.0}


SPECS = [
    SamplingSpec(temperature=1.0),
    SamplingSpec(temperature=0.7, top_k=3),
    SamplingSpec(temperature=1.3, top_p=0.6),
    SamplingSpec(temperature=1.0, min_p=0.2),
    SamplingSpec(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05),
    SamplingSpec(temperature=1.0, top_k=1),  # greedy
]
LOGITS = [2.0, 1.5, 1.4, 0.3, 0.0, -0.5, -1.0, -3.0]


def test_logprobs_and_greedy_rows_match_the_reference() -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(len(SPECS) + 1, 11, generator=g)
    specs = [*SPECS, None]  # a row no request owns any more
    banned = [[], [2, 7], [], [0], [], [int(scores[5].argmax())], []]
    tokens, logprobs = sample_rows(scores, specs, [None] * len(specs), banned)
    for i, spec in enumerate(specs):
        t = 1.0 if spec is None or spec.greedy else spec.temperature
        row = [(-math.inf if j in banned[i] and spec is not None else float(x)) / t for j, x in enumerate(scores[i])]
        top = max(row)
        norm = top + math.log(sum(math.exp(v - top) for v in row))
        for j, v in enumerate(row):
            want = v - norm
            got = float(logprobs[i, j])
            assert (got == want == -math.inf) or abs(got - want) < 1e-5, (i, j, got, want)
        if spec is None or spec.greedy:
            assert int(tokens[i]) == max(range(len(row)), key=lambda j: row[j]), i
    assert int(tokens[5]) != int(scores[5].argmax())  # the banned argmax was not taken


@pytest.mark.parametrize("index", range(len(SPECS) - 1))
def test_draws_stay_in_the_truncated_support_and_follow_its_distribution(index: int) -> None:
    torch.manual_seed(index)
    spec, banned = SPECS[index], [1] if index == 0 else []
    reference = allowed(LOGITS, spec, banned)
    rows, steps = 4000, 5
    scores = torch.tensor([LOGITS] * rows)
    counts = torch.zeros(len(LOGITS))
    for _ in range(steps):
        tokens, _ = sample_rows(scores, [spec] * rows, [None] * rows, [banned] * rows)
        counts += torch.bincount(tokens, minlength=len(LOGITS)).float()
    drawn = {i for i in range(len(LOGITS)) if counts[i] > 0}
    assert drawn <= set(reference), (drawn, reference)
    for token, p in reference.items():  # 20000 draws: 4 standard deviations at most ≈ 0.014
        assert abs(float(counts[token]) / (rows * steps) - p) < 0.015, (token, float(counts[token]), p)


def test_a_mixed_batch_draws_each_row_from_its_own_spec() -> None:
    torch.manual_seed(7)
    specs = [SPECS[i % 5] for i in range(500)]
    scores = torch.tensor([LOGITS] * 500)
    supports = [set(allowed(LOGITS, s, [])) for s in specs]
    for _ in range(20):
        tokens, _ = sample_rows(scores, specs, [None] * 500, [[]] * 500)
        assert all(int(t) in support for t, support in zip(tokens, supports))


def test_a_seed_reproduces_its_tokens_whatever_else_is_in_the_batch() -> None:
    spec = SamplingSpec(temperature=1.0, top_k=TOP_K_ALL)
    scores = torch.tensor([LOGITS] * 3)

    def draw(seed: int, neighbours: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(30):
            rows = torch.tensor([LOGITS] * (1 + neighbours))
            tokens, _ = sample_rows(rows, [spec] * (1 + neighbours), [gen] + [None] * neighbours,
                                    [[]] * (1 + neighbours))
            out.append(int(tokens[0]))
        return out

    assert draw(11, 0) == draw(11, 5)
    assert draw(11, 0) != draw(12, 0)
    assert scores.shape == (3, len(LOGITS))


def test_the_callers_logits_are_not_modified() -> None:
    scores = torch.tensor([LOGITS])
    before = scores.clone()
    sample_rows(scores, [SPECS[0]], [None], [[0, 1]])
    assert torch.equal(scores, before)
