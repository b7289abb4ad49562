"""Capacity planner: stage cost models and a discrete-event simulation of the RL pipeline (pure Python).

No Megatron, no torch: `tools/plan_resources.py` is the CLI. The question it answers: for a model,
a response-length distribution and G GPUs, how many GPUs should generate and how many train, and
what does asynchrony buy over synchronous colocated training?

Stage models (per engine of `engine_tp` GPUs, per trainer of `train_gpus` GPUs)::

    decode step with k sequences  = max(bytes / HBM BW, FLOPs / peak)        memory-bound for small k
        bytes = weights/tp + k · ctx · kv_bytes_per_token/tp,  FLOPs = 2 · N · k / tp
        → tokens/s = k / step grows with k until the FLOP term or the KV memory cap bites
    prefill of P tokens           = 2 · N · P / (peak · tp · prefill_mfu)      compute-bound
    train step on T tokens        = flops_factor(6) · N · T / (G_train · peak · mfu)
    weight sync                   = 2 · N bytes / link BW + fixed overhead

Simulation (`simulate`): engines serve requests by processor sharing (all sequences in an engine
advance one token per decode step, whose cost depends on how many there are). Per-engine "virtual
tokens served" S(t) makes each event O(log n): a request admitted at S0 with L tokens ends when S
reaches S0 + L. The trainer takes B samples when B are buffered, trains, pushes (V += 1).
Admission (docs/async_pipeline.md): sample j may start only when j < (V + α + 1) · B, so α = 0 is
the synchronous schedule on the same split and the rollout never waits for anything else.

    scheduling "queue": a request goes to the least-loaded engine the moment a slot frees
    scheduling "batch": a step's B requests start together; the next batch waits for the slowest
    prompt_replication off: a group's n responses are one request on one engine (n slots)
    extra_groups: start B/n + extra groups per batch, keep the first B/n complete (batch mode)
    env: each sample is `num_turns` segments separated by an environment latency; "async" frees
         the slot during env wait, "batch" steps every env of the batch together (barrier per turn)

Worked example (tests/unit/test_planner.py): two stages of 1 s each, constant lengths, α ≥ 1 →
1 s/step vs 2 s/step synchronous: speedup 2, the ceiling for two balanced stages.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
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

    @classmethod
    def from_models(cls, *, model: ModelSpec, gpu: GPUSpec, engine_tp: int, mean_ctx: float, max_ctx: float,
                    mfu: float = 0.4, prefill_mfu: float = 0.5, decode_mfu: float = 0.5, hbm_eff: float = 0.8,
                    max_running: int = 256, flops_factor: float = 6.0, sync_overhead_s: float = 1.0,
                    prompt_len: int = 512, decode_scale: float = 1.0) -> "Costs":
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
        sync = model.weight_bytes() / (gpu.link_gbs * 1e9) + sync_overhead_s
        return cls(decode_step=decode_step, engine_cap=cap, prefill_s=prefill, train_s=train_s, sync_s=sync)


@dataclasses.dataclass
class Result:
    sec_per_step: float
    samples_per_s: float
    train_idle_frac: float
    rollout_idle_frac: float
    staleness_mean: float


class _Engine:
    """Processor sharing with a per-engine virtual clock S (tokens served to every active sequence)."""

    def __init__(self, decode_step: Callable[[int], float]):
        self.step = decode_step
        self.S = 0.0
        self.t = 0.0
        self.ends: list[tuple[float, int]] = []  # (S at which the request ends, request id)
        self.slots = 0  # sequences in flight (a non-replicated group holds n)
        self.busy_s = 0.0

    def advance(self, t: float) -> None:
        if self.slots:
            self.S += (t - self.t) / self.step(self.slots)
            self.busy_s += t - self.t
        self.t = t

    def next_end(self) -> float:
        if not self.ends:
            return math.inf
        return self.t + max(0.0, self.ends[0][0] - self.S) * self.step(self.slots)


def simulate(*, work: Workload, costs: Costs, num_engines: int, train_gpus: int, alpha: int, num_steps: int,
             colocated: bool = False, scheduling: str = "queue", prompt_replication: bool = True,
             extra_groups: int = 0, env_mode: str = "async", seed: int = 0) -> Result:
    """Simulate `num_steps` train steps; see the module docstring. `colocated`: the same GPUs generate
    then train (synchronous: alpha is 0 and generation waits while the trainer holds the GPUs)."""
    if scheduling not in ("queue", "batch") or env_mode not in ("async", "batch"):
        raise ValueError(f"scheduling={scheduling!r} / env_mode={env_mode!r}: queue|batch, async|batch")
    B, n = work.batch_size, work.group_size
    if B % n:
        raise ValueError(f"batch_size={B} is not a multiple of group_size={n}")
    rng = random.Random(seed)
    alpha = 0 if colocated else alpha
    wave = scheduling == "batch" or (env_mode == "batch" and work.num_turns > 1) or extra_groups > 0
    groups_per_step = B // n
    per_group = n if prompt_replication else 1
    engines = [_Engine(costs.decode_step) for _ in range(num_engines)]
    requests: list[dict] = []
    queue: list[int] = []
    env_heap: list[tuple[float, int]] = []
    pending_env: list[int] = []  # batch env stepping: requests waiting for the rest of the wave
    buffer: list[int] = []  # start versions of finished samples, in finish order
    st = {"admitted": 0, "version": 0, "train_end": math.inf, "train_busy": 0.0, "wave": set(),
          "wave_done": 0, "steps": 0}
    group_left: dict[int, int] = {}
    step_ends: list[float] = []
    staleness: list[int] = []
    mean_tokens = work.prompt_len + _mean_len(work)
    t = 0.0

    def new_group() -> list[int]:
        samples = [[(max(1, int(work.lengths(rng))), work.env_latency(rng) if k < work.num_turns - 1 else 0.0)
                    for k in range(work.num_turns)] for _ in range(n)]
        if not prompt_replication:  # one request with n sequences: each turn lasts as long as its longest
            samples = [[(max(s[k][0] for s in samples), max(s[k][1] for s in samples))
                        for k in range(work.num_turns)]]
        gid = len(group_left)
        group_left[gid] = len(samples)
        ids = []
        for segs in samples:
            requests.append({"segs": segs, "turn": 0, "v": st["version"], "gid": gid,
                             "w": 1 if prompt_replication else n, "eng": None})
            ids.append(len(requests) - 1)
        queue.extend(ids)
        return ids

    def admit() -> None:
        if colocated and st["train_end"] < math.inf:
            return
        bound = (st["version"] + alpha + 1) * B
        if wave:
            if not st["wave"] and st["admitted"] + B <= bound:
                for _ in range(groups_per_step + extra_groups):
                    st["wave"].update(new_group())
                st["admitted"] += B  # extra groups are dropped at the wave's end, not counted
                st["wave_done"] = 0
            return
        while st["admitted"] + n <= bound:
            new_group()
            st["admitted"] += n

    def dispatch() -> None:
        keep = []
        for rid in queue:
            r = requests[rid]
            eng = min(engines, key=lambda e: e.slots)
            if eng.slots and eng.slots + r["w"] > costs.engine_cap:
                keep.append(rid)
                continue
            eng.advance(t)
            pre = costs.prefill_s / costs.decode_step(eng.slots + r["w"]) if r["turn"] == 0 else 0.0
            eng.slots += r["w"]
            heapq.heappush(eng.ends, (eng.S + r["segs"][r["turn"]][0] + pre, rid))
            r["eng"] = eng
        queue[:] = keep

    def close_wave() -> None:  # redundant prompts: abort what is left of the wave
        drop = st["wave"]
        for e in engines:
            if any(x[1] in drop for x in e.ends):
                e.advance(t)
                e.ends = [x for x in e.ends if x[1] not in drop]
                heapq.heapify(e.ends)
                e.slots = sum(requests[x[1]]["w"] for x in e.ends)
        queue[:] = [q for q in queue if q not in drop]
        env_heap[:] = [x for x in env_heap if x[1] not in drop]
        heapq.heapify(env_heap)
        pending_env.clear()
        st["wave"] = set()

    admit()
    dispatch()
    while st["steps"] < num_steps:
        te, ei = min(((e.next_end(), i) for i, e in enumerate(engines)), default=(math.inf, -1))
        tenv = env_heap[0][0] if env_heap else math.inf
        t = min(te, tenv, st["train_end"])
        if t == math.inf:
            raise RuntimeError("simulation stalled (engine cap below the group size without replication?)")
        if st["train_end"] == t:
            st["train_end"] = math.inf
            st["version"] += 1
            st["steps"] += 1
            step_ends.append(t)
        elif tenv == t:
            queue.insert(0, heapq.heappop(env_heap)[1])
        else:
            eng = engines[ei]
            eng.advance(t)
            rid = heapq.heappop(eng.ends)[1]
            r = requests[rid]
            eng.slots -= r["w"]
            r["turn"] += 1
            if r["turn"] < work.num_turns:
                latency = r["segs"][r["turn"] - 1][1]
                if wave and env_mode == "batch":
                    r["env_done"] = t + latency
                    pending_env.append(rid)
                else:
                    heapq.heappush(env_heap, (t + latency, rid))
            else:
                group_left[r["gid"]] -= 1
                if group_left[r["gid"]] == 0:
                    if not wave or st["wave_done"] < groups_per_step:
                        buffer.extend([r["v"]] * n)
                    if wave:
                        st["wave_done"] += 1
                        if st["wave_done"] >= groups_per_step:
                            close_wave()
        if pending_env and not queue and not any(e.slots for e in engines) and not env_heap:
            release = max(requests[rid]["env_done"] for rid in pending_env)  # every env steps together
            for rid in pending_env:
                heapq.heappush(env_heap, (release, rid))
            pending_env.clear()
        if st["train_end"] == math.inf and len(buffer) >= B and not (colocated and any(e.slots for e in engines)):
            batch, buffer[:] = buffer[:B], buffer[B:]
            staleness.extend(st["version"] - v for v in batch)
            dur = costs.train_s(train_gpus, int(B * mean_tokens)) + costs.sync_s
            st["train_end"] = t + dur
            st["train_busy"] += dur
        admit()
        dispatch()
    skip = min(max(alpha + 1, num_steps // 3), num_steps - 1)  # steady state: leave out the pipeline fill
    sec = (step_ends[-1] - (step_ends[skip - 1] if skip else 0.0)) / (num_steps - skip)
    total = step_ends[-1]
    for e in engines:
        e.advance(total)
    rollout_busy = sum(e.busy_s for e in engines) / max(1, len(engines)) / total
    train_busy = st["train_busy"] / total
    if colocated:  # the same GPUs: idle when neither generating nor training
        train_idle = rollout_idle = 1 - rollout_busy - train_busy
    else:
        train_idle, rollout_idle = 1 - train_busy, 1 - rollout_busy
    return Result(sec_per_step=sec, samples_per_s=B / sec, train_idle_frac=max(0.0, train_idle),
                  rollout_idle_frac=max(0.0, rollout_idle),
                  staleness_mean=sum(staleness) / max(1, len(staleness)))


_MEAN_CACHE: dict[int, float] = {}


def _mean_len(work: Workload) -> float:
    key = id(work.lengths)
    if key not in _MEAN_CACHE:
        r = random.Random(12345)
        _MEAN_CACHE[key] = sum(work.lengths(r) for _ in range(4000)) / 4000 * work.num_turns
    return _MEAN_CACHE[key]


# ---- length distributions -------------------------------------------------------------------------

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
