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
    """The subset of SGLang's `sampling_params` the CPU engine implements (same names, defaults, checks)."""

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
                raise ValueError(f"sampling_params.{key}={value!r} is not supported by the CPU engine")
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
    min_new_tokens). logprobs are of logits / T before any truncation, as SGLang reports them."""
    scores = scores.float().clone()
    temperatures = torch.ones(len(specs), 1, device=scores.device)
    for i, spec in enumerate(specs):
        if spec is None:
            continue
        if not spec.greedy:
            temperatures[i, 0] = spec.temperature
        if banned[i]:
            scores[i, sorted(banned[i])] = float("-inf")
    logprobs = torch.log_softmax(scores / temperatures, dim=-1)
    tokens = torch.argmax(scores, dim=-1)
    for i, spec in enumerate(specs):
        if spec is None or spec.greedy:
            continue
        probs = logprobs[i].exp()
        if spec.top_k < probs.numel():
            kth = torch.topk(probs, spec.top_k).values[-1]
            probs = torch.where(probs < kth, 0.0, probs)
        if spec.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            exclusive = torch.cumsum(sorted_probs, 0) - sorted_probs
            sorted_probs[exclusive > spec.top_p * sorted_probs.sum()] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if spec.min_p > 0.0:
            probs = torch.where(probs < spec.min_p * probs.max(), 0.0, probs)
        generator = generators[i]
        if generator is not None and generator.device != probs.device:  # seeded requests draw on the host
            probs = probs.cpu()
        tokens[i] = torch.multinomial(probs, 1, generator=generator)[0]
    return tokens, logprobs
