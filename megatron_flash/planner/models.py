"""Stage cost models of the capacity planner: the GPU table, model and workload shapes, and `Costs`,
the seconds each pipeline stage takes (from the models below, or measured and given directly).

Stage models (per engine of `engine_tp` GPUs, per trainer of `train_gpus` GPUs)::

    decode step with k sequences  = max(bytes / HBM BW, FLOPs / peak)        memory-bound for small k
        bytes = weights/tp + k · ctx · kv_bytes_per_token/tp,  FLOPs = 2 · N · k / tp
        → tokens/s = k / step grows with k until the FLOP term or the KV memory cap bites
    prefill of P tokens           = 2 · N · P / (peak · tp · prefill_mfu)      compute-bound
    train step on T tokens        = flops_factor(6) · N · T / (G_train · peak · mfu)
    weight sync                   = push bytes / link BW + fixed overhead
        push bytes (whole)        = 2 · N
        push bytes (delta, density d, an anchor every A pushes)
                                  = (2·N + (A − 1) · N · (2·d + min(4·d, 1/8))) / A
        (values changed at 2 bytes each, their positions as int32 or a bitmask: weight_sync/delta.py)
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable, Sequence

GPU_TABLE: dict[str, dict[str, float]] = {
    # peak dense bf16 FLOP/s, HBM GB/s, memory GB, inter-node link GB/s per GPU (IB NDR 400 Gb/s)
    "H100": {"flops": 989e12, "hbm_gbs": 3350.0, "mem_gb": 80.0, "link_gbs": 50.0},
    "H200": {"flops": 989e12, "hbm_gbs": 4800.0, "mem_gb": 141.0, "link_gbs": 50.0},
    "A100": {"flops": 312e12, "hbm_gbs": 2039.0, "mem_gb": 80.0, "link_gbs": 25.0},
}


@dataclasses.dataclass
class ModelSpec:
    num_params: float
    """Parameters N."""
    num_layers: int = 32
    hidden_size: int = 4096
    num_kv_heads: int = 8
    head_dim: int = 0
    """0 = hidden_size / 32 heads' worth (hidden_size // 32 * 32 / num_attention_heads guessed as 128)."""
    bytes_per_param: float = 2.0

    def kv_bytes_per_token(self) -> float:
        head_dim = self.head_dim or 128
        return 2.0 * self.num_layers * self.num_kv_heads * head_dim * self.bytes_per_param

    def weight_bytes(self) -> float:
        return self.num_params * self.bytes_per_param

    def push_bytes(self, delta_density: float = 0.0, anchor_every: int = 20) -> float:
        """Bytes of one push averaged over the anchor cycle; density 0 = whole pushes (no delta)."""
        full = self.weight_bytes()
        if delta_density <= 0:
            return full
        if not 0 < delta_density <= 1:
            raise ValueError(f"delta density must be in (0, 1], got {delta_density!r}")
        delta = self.num_params * (self.bytes_per_param * delta_density + min(4.0 * delta_density, 1.0 / 8))
        delta = min(delta, full)
        if anchor_every <= 0:
            return delta
        return (full + (anchor_every - 1) * delta) / anchor_every


@dataclasses.dataclass
class GPUSpec:
    name: str
    flops: float
    hbm_gbs: float
    mem_gb: float
    link_gbs: float

    @classmethod
    def from_name(cls, name: str, **overrides: float) -> "GPUSpec":
        if name not in GPU_TABLE and not overrides:
            raise ValueError(f"gpu={name!r}: known {sorted(GPU_TABLE)}, or give flops/hbm_gbs/mem_gb/link_gbs")
        base = dict(GPU_TABLE.get(name, {}))
        base.update({k: float(v) for k, v in overrides.items() if v})
        missing = [k for k in ("flops", "hbm_gbs", "mem_gb", "link_gbs") if k not in base]
        if missing:
            raise ValueError(f"custom gpu {name!r} needs {missing}")
        return cls(name=name, **base)


@dataclasses.dataclass
class Workload:
    batch_size: int
    """B: samples per train step."""
    group_size: int = 8
    prompt_len: int = 512
    lengths: Callable[[random.Random], int] = lambda rng: 1024
    """Sampler of one response length (tokens)."""
    num_turns: int = 1
    env_latency: Callable[[random.Random], float] = lambda rng: 0.0
    keep_prob: float = 1.0
    """Dynamic filter: the fraction of finished groups kept (e.g. nonzero_std drops groups whose
    rewards are all equal); a dropped group frees its admission slot and another prompt starts."""
    max_inflight_groups: int = 0
    """Groups generating at once at most (agentic: env instances / group size); 0 = bounded by α only."""
    turn_tokens: int = 0
    """Agentic: tokens each environment turn appends to the conversation (observation and chat template),
    prefilled before the next turn (see `Costs.prefill_token_engine_s`)."""


@dataclasses.dataclass
class Costs:
    """Per-stage costs, from the models (`Costs.from_models`) or measured and given directly."""
    decode_step: Callable[[int], float]
    """Seconds of one decode step of one engine with k sequences in flight."""
    engine_cap: int
    """Most sequences one engine holds (KV memory / configured cap)."""
    prefill_s: float
    """Seconds of one prompt's prefill (added to the request's first segment)."""
    train_s: Callable[[int, int], float]
    """(train_gpus, tokens) -> seconds of one train step."""
    sync_s: float
    per_request_s: float = 0.0
    """Seconds every request (every turn of an episode) adds to its own time on the engine besides its
    decode steps (HTTP round trip, scheduling): turned into decode steps at admission, so it holds the
    request's slot but is shared with the other sequences like decoding (latency more than load)."""
    request_engine_s: float = 0.0
    """Engine-exclusive seconds per request (every turn of an episode): while the engine spends them no
    sequence advances, so unlike `per_request_s` they add up over concurrent requests (a local engine's
    HTTP handling, admission and prefill under one GIL). `benchmarks/engine_step_cost.py --loop-k`
    measures it with requests arriving one at a time, as a rollout sends them. Charged once per
    request, also for a request of n sampled sequences: `--loop-n 1,8` measured an 8-sequence request
    at 3.3-6.5 ms vs 4.1-6.8 ms for a single one (local engine server, quiet 2-core box, 2026-11-24)."""
    client_per_request_s: float = 0.0
    """Seconds of the rollout client (one asyncio loop: scheduler, proxy, HTTP, rewards) per request;
    requests pass it one at a time before they reach an engine, so it caps requests/s."""
    prefill_token_engine_s: float = 0.0
    """Engine-exclusive seconds per prefilled token beyond the short prompt `request_engine_s` was measured
    with (`benchmarks/engine_step_cost.py --loop-prompt-len 2,100`): charged for the prompt at a request's
    first turn and, at each later turn of an episode, for the tokens the engine has not cached."""
    prefix_cache: bool = True
    """The engine keeps a finished turn's KV (SGLang's radix cache): a later turn prefills only the tokens the
    environment appended (`Workload.turn_tokens`). False (the local engine server): the whole conversation again."""

    @classmethod
    def from_models(cls, *, model: ModelSpec, gpu: GPUSpec, engine_tp: int, mean_ctx: float, max_ctx: float,
                    mfu: float = 0.4, prefill_mfu: float = 0.5, decode_mfu: float = 0.5, hbm_eff: float = 0.8,
                    max_running: int = 256, flops_factor: float = 6.0, sync_overhead_s: float = 1.0,
                    prompt_len: int = 512, decode_scale: float = 1.0, delta_density: float = 0.0,
                    anchor_every: int = 20) -> "Costs":
        n, tp = model.num_params, engine_tp
        kv = model.kv_bytes_per_token()
        free = gpu.mem_gb * 1e9 * tp * 0.9 - model.weight_bytes()
        if free <= 0:
            raise ValueError(f"engine_tp={tp}: {model.weight_bytes()/1e9:.0f} GB of weights do not fit in "
                             f"{tp} × {gpu.mem_gb} GB")
        cap = max(1, min(max_running, int(free / (kv * max_ctx))))

        def decode_step(k: int) -> float:
            mem = (model.weight_bytes() + k * mean_ctx * kv) / tp / (gpu.hbm_gbs * 1e9 * hbm_eff)
            comp = 2.0 * n * k / tp / (gpu.flops * decode_mfu)
            return decode_scale * max(mem, comp)

        def train_s(train_gpus: int, tokens: int) -> float:
            return flops_factor * n * tokens / (train_gpus * gpu.flops * mfu)

        prefill = 2.0 * n * prompt_len / (tp * gpu.flops * prefill_mfu)
        sync = model.push_bytes(delta_density, anchor_every) / (gpu.link_gbs * 1e9) + sync_overhead_s
        return cls(decode_step=decode_step, engine_cap=cap, prefill_s=prefill, train_s=train_s, sync_s=sync)


def measured_decode(points: Sequence[tuple[int, float]]) -> Callable[[int], float]:
    """Decode-step seconds vs sequences in flight from measurements [(k, seconds), ...]: piecewise
    linear between the points, the end segments' lines beyond them (never below the smallest
    measured cost)."""
    pts = sorted((int(k), float(v)) for k, v in points)
    if len(pts) < 2 or len({k for k, _ in pts}) != len(pts):
        raise ValueError(f"measured_decode needs two or more distinct sequence counts, got {points!r}")

    def step(k: int) -> float:
        i = 1
        while i < len(pts) - 1 and k > pts[i][0]:
            i += 1
        (k0, v0), (k1, v1) = pts[i - 1], pts[i]
        return max(pts[0][1] if k >= pts[0][0] else 0.0, v0 + (v1 - v0) * (k - k0) / (k1 - k0))
    return step
