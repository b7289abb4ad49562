"""SGLang's sampling semantics for the local engine: the per-request parameters (`SamplingSpec`, parsed from
a /generate body with SGLang's defaults and checks) and the per-step choice of tokens (`sample_rows`).

SGLang reports log_softmax(logits / T) *before* top-k / top-p / min-p (T = 1 for greedy) and mixes greedy
and sampled requests in one batch; `sample_rows` does exactly that on the raw fp32 logits of one decode
step, one row per request.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import torch

TOP_K_ALL = 1 << 30
_SAMPLING_EPS = 1e-6
@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingSpec:
    """The subset of SGLang's `sampling_params` the local engine implements (same names, defaults, checks)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    sampling_seed: int | None = None

    # Accepted only at their neutral value: anything else changes the distribution in ways not implemented here.
    _NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "n": 1,
                "stop": None, "stop_regex": None, "json_schema": None, "regex": None, "ebnf": None,
                "structural_tag": None, "logit_bias": None, "beam_width": None, "custom_params": None}
    _IGNORED = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval")

    @property
    def greedy(self) -> bool:
        return self.top_k == 1

    @classmethod
    def from_json(cls, params: dict | None, *, vocab_size: int) -> "SamplingSpec":
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"sampling_params must be an object, got {type(params).__name__}")
        params = dict(params or {})
        for key, neutral in cls._NEUTRAL.items():
            value = params.pop(key, None)
            if value not in (None, neutral, [], "", {}):
                raise ValueError(f"sampling_params.{key}={value!r} is not supported by the local engine")
        for key in cls._IGNORED:
            params.pop(key, None)
        known = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "min_new_tokens", "stop_token_ids",
                 "ignore_eos", "sampling_seed"}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown sampling_params: {unknown}")

        def get(name: str, default: Any) -> Any:
            value = params.get(name)
            return default if value is None else value

        temperature, top_k = float(get("temperature", 1.0)), int(get("top_k", -1))
        max_new_tokens, min_new_tokens = int(get("max_new_tokens", 128)), int(get("min_new_tokens", 0))
        top_p, min_p = float(get("top_p", 1.0)), float(get("min_p", 0.0))
        if not math.isfinite(temperature) or temperature < 0.0:
            raise ValueError(f"temperature must be a non-negative finite number, got {temperature}.")
        if 0 <= temperature < _SAMPLING_EPS:  # SGLang: greedy is top_k = 1 at temperature 1
            temperature, top_k = 1.0, 1
        if top_k == -1:
            top_k = TOP_K_ALL
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}.")
        if top_k < 1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
        if not 0 <= min_new_tokens <= max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens({max_new_tokens})], got {min_new_tokens}.")
        stop_ids = frozenset(int(t) for t in (params.get("stop_token_ids") or []) if t is not None)
        if any(not 0 <= t < vocab_size for t in stop_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size - 1}], got {sorted(stop_ids)}")
        seed = params.get("sampling_seed")
        return cls(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                   min_new_tokens=min_new_tokens, stop_token_ids=stop_ids, ignore_eos=bool(get("ignore_eos", False)),
                   sampling_seed=None if seed is None else int(seed))


@torch.no_grad()
def sample_rows(scores: torch.Tensor, specs: Sequence[Optional[SamplingSpec]],
                generators: Sequence[Optional[torch.Generator]],
                banned: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [n], logprobs [n, V]) for one step. Row i: `specs[i]` (None: a row no request owns any
    more, taken greedily and ignored), `banned[i]` token ids masked out first (stop ids before
    min_new_tokens). logprobs are of logits / T before any truncation, as SGLang reports them.

    Batched over rows, and drawn by inverse CDF rather than torch.multinomial: a per-row loop of
    multinomials cost 62 ms a step for 64 rows of a 32k vocabulary on one CPU core (CPU multinomial
    alone 42 ms batched), and on a GPU several kernel launches per sequence per step. Seeded rows take
    their uniform from their own generator, so a seed reproduces its tokens."""
    scores = scores.float()
    device, num_rows = scores.device, len(specs)
    temperatures = torch.tensor([1.0 if s is None or s.greedy else s.temperature for s in specs],
                                dtype=torch.float32).to(device).view(num_rows, 1)
    ban_rows = [i for i, ids in enumerate(banned) for _ in ids if specs[i] is not None]
    if ban_rows:
        ban_cols = [t for i, ids in enumerate(banned) if specs[i] is not None for t in ids]
        scores = scores.clone()  # the caller's logits stay as they are
        scores[torch.tensor(ban_rows).to(device), torch.tensor(ban_cols).to(device)] = float("-inf")
    logprobs = torch.log_softmax(scores / temperatures, dim=-1)
    rows = [i for i, s in enumerate(specs) if s is not None and not s.greedy]
    if not rows:
        return torch.argmax(scores, dim=-1), logprobs
    picked = [specs[i] for i in rows]
    sampled = logprobs if len(rows) == num_rows else logprobs[torch.tensor(rows).to(device)]
    probs = truncated_probs(sampled.exp(), picked)
    # Inverse CDF, one uniform in (0, 1] per row (a zero-probability token is never at the found index);
    # float64 sums so that a 150k vocabulary's small probabilities keep their share.
    uniform = torch.empty(len(rows), 1, dtype=torch.float64)
    free = [j for j, i in enumerate(rows) if generators[i] is None]
    uniform[free] = torch.rand(len(free), 1, dtype=torch.float64)
    for j, i in enumerate(rows):
        if generators[i] is not None:  # seeded requests draw from their own generator (host or device)
            uniform[j] = torch.rand(1, generator=generators[i], dtype=torch.float64,
                                    device=generators[i].device).cpu()
    cdf = probs.cumsum(-1, dtype=torch.float64)
    found = torch.searchsorted(cdf, (1.0 - uniform).to(device) * cdf[:, -1:])[:, 0]
    found.clamp_(max=probs.size(-1) - 1)
    if len(rows) == num_rows:
        return found, logprobs
    tokens = torch.argmax(scores, dim=-1)
    tokens[torch.tensor(rows).to(device)] = found
    return tokens, logprobs


def truncated_probs(probs: torch.Tensor, specs: Sequence[SamplingSpec]) -> torch.Tensor:
    """Top-k (ties with the k-th kept), then top-p on what is left (a token is dropped once the mass of
    the tokens before it exceeds top_p of that mass), then min-p (below min_p × the largest dropped), per
    row of `probs` [m, V] with `specs[j]`; unnormalized, as multinomial takes it."""
    vocab = probs.size(-1)
    top_k = [s.top_k for s in specs]
    top_p = [s.top_p for s in specs]
    min_p = [s.min_p for s in specs]
    if any(k < vocab for k in top_k):
        ks = torch.tensor([min(k, vocab) for k in top_k]).to(probs.device)
        kth = torch.topk(probs, int(ks.max()), dim=-1).values.gather(1, (ks - 1).view(-1, 1))
        probs = torch.where(probs < kth, 0.0, probs)
    if any(p < 1.0 for p in top_p):
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        exclusive = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        limit = torch.tensor(top_p, dtype=probs.dtype).to(probs.device).view(-1, 1) * sorted_probs.sum(-1, keepdim=True)
        sorted_probs = torch.where(exclusive > limit, 0.0, sorted_probs)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    if any(p > 0.0 for p in min_p):
        floor = torch.tensor(min_p, dtype=probs.dtype).to(probs.device).view(-1, 1) * probs.amax(-1, keepdim=True)
        probs = torch.where(probs < floor, 0.0, probs)
    return probs
