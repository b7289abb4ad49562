"""Response-length distributions for the planner's `Workload.lengths`: samplers (1/k long tail,
lognormal, an empirical list), a reader of measured lengths from run outputs (jsonl), and the mean
length of a sampler (which sizes the train step)."""

from __future__ import annotations

import json
import math
import random
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from megatron_flash.planner.models import Workload

_MEAN_CACHE: dict[int, tuple[Callable, int, float]] = {}


def mean_len(work: Workload) -> float:
    """Mean response tokens per sample (all turns), from 4000 draws; cached per sampler. The entry keeps the
    sampler alive so that its id cannot be reused by a later sampler (a stale mean would be returned)."""
    key = id(work.lengths)
    hit = _MEAN_CACHE.get(key)
    if hit is None or hit[0] is not work.lengths or hit[1] != work.num_turns:
        r = random.Random(12345)
        hit = (work.lengths, work.num_turns, sum(work.lengths(r) for _ in range(4000)) / 4000 * work.num_turns)
        _MEAN_CACHE[key] = hit
    return hit[2]


def inv_k_lengths(max_len: int) -> Callable[[random.Random], int]:
    """P(k) ∝ 1/k, 1 ≤ k ≤ max_len (benchmarks/benchlib.py's long tail)."""
    weights = [1.0 / k for k in range(1, max_len + 1)]
    cum, s = [], 0.0
    for w in weights:
        s += w
        cum.append(s)

    def draw(rng: random.Random) -> int:
        import bisect
        return bisect.bisect_left(cum, rng.random() * s) + 1
    return draw


def lognormal_lengths(mean: float, sigma: float, max_len: int) -> Callable[[random.Random], int]:
    mu = math.log(mean) - sigma * sigma / 2
    return lambda rng: int(min(max_len, max(1.0, rng.lognormvariate(mu, sigma))))


def empirical_lengths(samples: Sequence[int]) -> Callable[[random.Random], int]:
    if not samples:
        raise ValueError("samples file gave no response lengths")
    data = list(samples)
    return lambda rng: data[rng.randrange(len(data))]


def read_lengths_file(path: str) -> list[int]:
    """Response lengths from a jsonl: metrics (response_len_mean), groups dumps (samples' response ids),
    or rows with `response_len` / `response_length`."""
    out: list[int] = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            out.extend(_lengths_of(row))
    return out


def _lengths_of(row: object) -> list[int]:
    if isinstance(row, list):
        return [x for r in row for x in _lengths_of(r)]
    if not isinstance(row, dict):
        return []
    for key in ("response_len", "response_length", "response_len_mean"):
        if key in row and isinstance(row[key], (int, float)):
            return [int(round(row[key]))]
    for key in ("response_ids", "response_tokens", "response_token_ids"):
        if key in row and isinstance(row[key], list):
            return [len(row[key])]
    if "samples" in row:
        return _lengths_of(row["samples"])
    return []
