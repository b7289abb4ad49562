"""SGLang sampling as tensors in, tensors out: the static decoder's sampler, run inside its decode step
(and inside the CUDA graph that captures it), with no host sync and no per-request Python.

Semantics are those of `sampling.sample_rows` (the reference, which the continuous-batching path
uses): log_softmax(logits / T) before any truncation is the reported logprob (T = 1 for greedy);
top-k keeps ties with the k-th, then top-p on what is left, then min-p; the token is drawn by inverse
CDF over the vocabulary in vocabulary order with one uniform per row. Given the same uniform both
pick the same token (tests/unit/test_device_sampling.py).

Where the uniform comes from: a counter-based hash of (request seed, index of the output token), so
a seeded request reproduces its tokens whatever else is in the batch, after a retract, and inside a
replayed graph (a generator's state would be baked into the graph). Unseeded requests get a seed
drawn from the engine's generator at admission.
"""

from __future__ import annotations

import torch

_MASK31 = (1 << 31) - 1


def seed_uniform(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """A uniform in (0, 1) per row from int64 `seed` [n] and `step` [n], in float64.

    31-bit arithmetic in int64 (every product stays below 2**62, so no overflow on any device):
    the 64-bit seed is folded to 31 bits, mixed with the step, then three multiply-xorshift rounds."""
    x = (seed & _MASK31) ^ ((seed >> 31) & _MASK31) ^ ((seed >> 62) & 3)
    x = x ^ ((step * 0x2545F491) & _MASK31)
    for mul in (0x2C1B3C6D, 0x297A2D39, 0x1B873593):
        x = ((x ^ (x >> 15)) * mul) & _MASK31
    x = x ^ (x >> 13)
    return (x.double() + 0.5) / float(1 << 31)


def ban_tokens(logits: torch.Tensor, ban_ids: torch.Tensor, ban_on: torch.Tensor) -> torch.Tensor:
    """`logits` [n, V] with -inf at `ban_ids` [n, K] where `ban_on` [n, K]; padding entries repeat a
    real id of the row with the same flag, so repeated indices always write the same value."""
    current = logits.gather(1, ban_ids)
    return logits.scatter(1, ban_ids, torch.where(ban_on, float("-inf"), current))


def sample_device(logits: torch.Tensor, *, temperature: torch.Tensor, greedy: torch.Tensor,
                  top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, uniform: torch.Tensor,
                  truncate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [n] int64, logprob of each token [n] float32) for logits [n, V].

    temperature [n] (1 for greedy rows), greedy [n] bool, top_k [n] int64 (≥ V: off), top_p [n],
    min_p [n], uniform [n] float64 in (0, 1). `truncate=False` skips top-k/top-p/min-p (a sort of the
    whole vocabulary): the caller passes it when no row in the batch truncates."""
    logits = logits.float()
    vocab = logits.size(-1)
    logprobs = torch.log_softmax(logits / temperature.view(-1, 1), dim=-1)
    probs = logprobs.exp()
    if truncate:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        kth = sorted_probs.gather(1, (top_k.clamp(min=1, max=vocab) - 1).view(-1, 1))
        sorted_probs = torch.where(sorted_probs < kth, 0.0, sorted_probs)
        exclusive = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        limit = top_p.view(-1, 1) * sorted_probs.sum(-1, keepdim=True)
        sorted_probs = torch.where(exclusive > limit, 0.0, sorted_probs)
        sorted_probs = torch.where(sorted_probs < min_p.view(-1, 1) * sorted_probs[:, :1], 0.0, sorted_probs)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)  # back to vocabulary order
    cdf = probs.cumsum(-1, dtype=torch.float64)
    found = torch.searchsorted(cdf, ((1.0 - uniform).view(-1, 1) * cdf[:, -1:]).contiguous())[:, 0]
    found = found.clamp(max=vocab - 1)
    tokens = torch.where(greedy, torch.argmax(logits, dim=-1), found)
    return tokens, logprobs.gather(1, tokens.view(-1, 1))[:, 0]
