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
the synchronous schedule on the same split and the rollout never waits for anything else. Expiry,
as in the product: without redundancy a group started at v must train by step v + α, so the trainer
waits while such a group is still generating and puts it first in the batch (a long response delays
at most the step that is due to train it; nothing is discarded; staleness ≤ α).

    scheduling "queue": a request goes to the least-loaded engine the moment a slot frees
    scheduling "batch": a step's B requests start together; the next batch waits for the slowest
    prompt_replication off: a group's n responses are one request on one engine: it needs n free
         slots and holds them until its last member ends (the proxy's accounting), while each member
         decodes its own length and leaves the decode batch when it ends (the engine stops a finished
         sequence); replication_chunk=k: ceil(n/k) requests of k sequences
    keep_prob (dynamic filter): a finished group is kept with this probability; queue: a dropped
         group frees its admission slot at once; batch: the step's missing groups start again in a
         new round once the round's last group ends
    extra_groups (redundant prompts): queue: admission allows B/n + extra groups beyond the α
         bound, the trainer takes the first B/n kept, and at each push groups too stale to train
         (start version < V − α) are cancelled, buffered or in flight; batch: each round starts
         `extra` more groups and the rest of the round is aborted once B/n are kept
    env: each sample is `num_turns` segments separated by an environment latency; "async" frees
         the slot during env wait, "batch" steps every env of the batch together (barrier per turn);
         max_inflight_groups caps groups generating at once (env instances)
    per_request_s: seconds every request adds to its own time on the engine besides decoding (HTTP
         round trip, prefill again); processor-shared like decoding, so it holds the request's slot
         but barely slows the others where a step costs the same for 1 or k sequences
    request_engine_s: engine-exclusive seconds per request: the engine decodes nothing meanwhile (a
         CPU engine's HTTP handling, admission and prefill under one GIL); k requests cost k times it
    client_per_request_s: the rollout client handles requests one at a time before they start
    prefill_token_engine_s: engine-exclusive seconds per prefilled token: the prompt, and at each later turn
         the env's appended tokens (prefix_cache) or the whole conversation again (no prefix cache)

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
    sequence advances, so unlike `per_request_s` they add up over concurrent requests (a CPU engine's
    HTTP handling, admission and prefill under one GIL). `benchmarks/engine_step_cost.py --loop-k`
    measures it with requests arriving one at a time, as a rollout sends them. Charged once per
    request, also for a request of n sampled sequences: `--loop-n 1,8` measured an 8-sequence request
    at 3.3-6.5 ms vs 4.1-6.8 ms for a single one (CPU server, quiet 2-core box, session 5)."""
    client_per_request_s: float = 0.0
    """Seconds of the rollout client (one asyncio loop: scheduler, proxy, HTTP, rewards) per request;
    requests pass it one at a time before they reach an engine, so it caps requests/s."""
    prefill_token_engine_s: float = 0.0
    """Engine-exclusive seconds per prefilled token beyond the short prompt `request_engine_s` was measured
    with (`benchmarks/engine_step_cost.py --loop-prompt-len 2,100`): charged for the prompt at a request's
    first turn and, at each later turn of an episode, for the tokens the engine has not cached."""
    prefix_cache: bool = True
    """The engine keeps a finished turn's KV (SGLang's radix cache): a later turn prefills only the tokens the
    environment appended (`Workload.turn_tokens`). False (the CPU server): the whole conversation again."""

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


@dataclasses.dataclass
class Result:
    sec_per_step: float
    samples_per_s: float
    train_idle_frac: float
    rollout_idle_frac: float
    staleness_mean: float
    total_s: float = 0.0
    """Time at which the last simulated step ended."""
    groups_dropped: int = 0
    """Finished groups the dynamic filter dropped."""
    groups_cancelled: int = 0
    """Groups aborted unfinished (the rest of a redundant wave) or expired (too stale to train)."""


class _Engine:
    """Processor sharing with a per-engine virtual clock S (tokens served to every active sequence)."""

    def __init__(self, decode_step: Callable[[int], float]):
        self.step = decode_step
        self.S = 0.0
        self.t = 0.0
        self.ends: list[tuple[float, int]] = []  # (S at which the request ends, request id)
        self.slots = 0  # sequences decoding (a request of n sampled sequences: its members not yet ended)
        self.held = 0  # admission slots held (the proxy: a request of n holds n until its last member ends)
        self.busy_s = 0.0
        self.stall = 0.0  # engine-exclusive seconds still owed (request_engine_s): nothing decodes meanwhile

    def advance(self, t: float) -> None:
        dt = t - self.t
        if self.stall:
            used = min(self.stall, dt)
            self.stall -= used
            self.busy_s += used
            dt -= used
        if self.slots and dt > 0:
            self.S += dt / self.step(self.slots)
            self.busy_s += dt
        self.t = t

    def next_end(self) -> float:
        if not self.ends:
            return math.inf
        return self.t + self.stall + max(0.0, self.ends[0][0] - self.S) * self.step(self.slots)


def simulate(*, work: Workload, costs: Costs, num_engines: int, train_gpus: int, alpha: int, num_steps: int,
             colocated: bool = False, scheduling: str = "queue", prompt_replication: bool = True,
             replication_chunk: int = 0, extra_groups: int = 0, env_mode: str = "async", seed: int = 0) -> Result:
    """Simulate `num_steps` train steps; see the module docstring. `colocated`: the same GPUs generate
    then train (synchronous: alpha is 0 and generation waits while the trainer holds the GPUs).
    A group's n responses go out as n requests (prompt_replication), one request of n sequences
    (prompt_replication=False), or requests of `replication_chunk` sequences."""
    if scheduling not in ("queue", "batch") or env_mode not in ("async", "batch"):
        raise ValueError(f"scheduling={scheduling!r} / env_mode={env_mode!r}: queue|batch, async|batch")
    B, n = work.batch_size, work.group_size
    if B % n:
        raise ValueError(f"batch_size={B} is not a multiple of group_size={n}")
    if not 0.0 < work.keep_prob <= 1.0:
        raise ValueError(f"keep_prob={work.keep_prob}: must be in (0, 1]")
    rng = random.Random(seed)
    alpha = 0 if colocated else alpha
    wave = scheduling == "batch" or (env_mode == "batch" and work.num_turns > 1)
    gps = B // n  # groups per step
    chunk = replication_chunk if replication_chunk > 1 else (1 if prompt_replication else n)
    engines = [_Engine(costs.decode_step) for _ in range(num_engines)]
    requests: list[dict] = []
    groups: list[dict] = []
    queue: list[int] = []
    env_heap: list[tuple[float, int]] = []
    pending_env: list[int] = []  # batch env stepping: requests waiting for the rest of the wave
    buffer: list[int] = []  # finished, kept groups in finish order
    client: list[tuple[float, int]] = []  # requests leaving the rollout client: (time, id)
    st = {"client_free": 0.0, "admitted": 0, "inflight": 0, "version": 0, "train_end": math.inf, "train_busy": 0.0, "steps": 0,
          "waves": 0, "dropped": 0, "cancelled": 0}
    cur: dict = {"gids": set(), "kept": 0}  # the open wave (batch scheduling)
    live: set[int] = set()  # groups generating (not finished, dropped or cancelled)
    waits = not wave and not extra_groups  # the trainer waits for groups that would expire (see take_batch)
    step_ends: list[float] = []
    staleness: list[int] = []
    mean_tokens = work.prompt_len + _mean_len(work)
    t = 0.0

    def new_group() -> int:
        samples = [[(max(1, int(work.lengths(rng))), work.env_latency(rng) if k < work.num_turns - 1 else 0.0)
                    for k in range(work.num_turns)] for _ in range(n)]
        gid = len(groups)
        keep = work.keep_prob >= 1.0 or rng.random() < work.keep_prob
        ids = []
        for c in range(0, n, chunk):  # one request per chunk of members (n sampled sequences)
            part = samples[c:c + chunk]
            # each member decodes its own length and leaves the batch when it ends (the engine stops a
            # finished member); the request's turn ends with its longest member, then the slowest env step
            segs = [([x[k][0] for x in part], max(x[k][1] for x in part)) for k in range(work.num_turns)]
            requests.append({"segs": segs, "turn": 0, "gid": gid, "w": len(part), "left_m": 0, "live": True,
                             "ctx": work.prompt_len})
            ids.append(len(requests) - 1)
        groups.append({"v": st["version"], "left": len(ids), "keep": keep, "reqs": ids, "done": False})
        live.add(gid)
        st["inflight"] += 1
        for rid in ids:
            to_client(rid)
        return gid

    def to_client(rid: int) -> None:
        """The request passes the rollout client (FIFO, one at a time) before it may start."""
        if not costs.client_per_request_s:
            queue.append(rid)
            return
        st["client_free"] = max(st["client_free"], t) + costs.client_per_request_s
        heapq.heappush(client, (st["client_free"], rid))

    def room() -> bool:
        return not work.max_inflight_groups or st["inflight"] < work.max_inflight_groups

    def admit() -> None:
        if colocated and st["train_end"] < math.inf:
            return
        if wave:
            if not cur["gids"] and st["waves"] < st["version"] + alpha + 1:
                st["waves"] += 1
                cur["kept"] = 0
                start_round()
            return
        while st["admitted"] < (st["version"] + alpha + 1) * gps + extra_groups and room():
            new_group()
            st["admitted"] += 1

    def start_round() -> None:  # batch: the step's missing groups (plus redundant ones) start together
        for _ in range(gps - cur["kept"] + extra_groups):
            cur["gids"].add(new_group())

    def cancel(gids: set) -> None:
        """Abort these groups' requests wherever they are (engine, queue, env wait)."""
        rids = {r for g in gids for r in groups[g]["reqs"] if requests[r]["live"]}
        for r in rids:
            requests[r]["live"] = False
        for e in engines:
            if any(x[1] in rids for x in e.ends):
                e.advance(t)
                e.ends = [x for x in e.ends if x[1] not in rids]
                heapq.heapify(e.ends)
                e.slots = len(e.ends)  # one entry per member still decoding
                e.held = sum(requests[r]["w"] for r in {x[1] for x in e.ends})
        queue[:] = [q for q in queue if q not in rids]
        env_heap[:] = [x for x in env_heap if x[1] not in rids]
        heapq.heapify(env_heap)
        client[:] = [x for x in client if x[1] not in rids]
        heapq.heapify(client)
        pending_env[:] = [q for q in pending_env if q not in rids]
        for g in gids:
            if not groups[g]["done"]:
                groups[g]["done"] = True
                live.discard(g)
                st["inflight"] -= 1
                st["cancelled"] += 1

    def dispatch() -> None:
        keep = []
        for rid in queue:
            r = requests[rid]
            eng = min(engines, key=lambda e: e.held)
            if eng.held and eng.held + r["w"] > costs.engine_cap:
                keep.append(rid)
                continue
            eng.advance(t)
            extra_s = costs.per_request_s + (costs.prefill_s if r["turn"] == 0 else 0.0)
            pre = extra_s / costs.decode_step(eng.slots + r["w"]) if extra_s else 0.0
            eng.slots += r["w"]
            eng.held += r["w"]  # admitted jointly: all members need a slot, freed when the last ends
            eng.stall += costs.request_engine_s + costs.prefill_token_engine_s * prefill_tokens(r)
            r["left_m"] = r["w"]
            for length in r["segs"][r["turn"]][0]:
                heapq.heappush(eng.ends, (eng.S + length + pre, rid))
        queue[:] = keep

    def prefill_tokens(r: dict) -> int:
        """Tokens this turn of the request prefills: the prompt at turn 0; later, what the engine has not
        cached (with a prefix cache the appended env tokens, without it the whole conversation)."""
        if r["turn"] == 0 or not costs.prefix_cache:
            return r["ctx"]
        return work.turn_tokens

    def group_done(gid: int) -> None:
        g = groups[gid]
        g["done"] = True
        live.discard(gid)
        st["inflight"] -= 1
        if not wave:
            if g["keep"]:
                buffer.append(gid)
            else:
                st["dropped"] += 1
                st["admitted"] -= 1  # its admission slot goes to a new prompt
            return
        cur["gids"].discard(gid)
        if not g["keep"]:
            st["dropped"] += 1
        elif cur["kept"] < gps:
            cur["kept"] += 1
            buffer.append(gid)
        if cur["kept"] >= gps:
            cancel(set(cur["gids"]))  # redundant prompts: abort what is left of the wave
            cur["gids"] = set()
        elif not cur["gids"]:
            start_round()  # the filter left the step short: generate the missing groups again

    def expire() -> None:
        """After a push: groups that can no longer be trained within α (redundant surplus) go."""
        floor = st["version"] - alpha
        stale_buffered = [g for g in buffer if groups[g]["v"] < floor]
        if stale_buffered:
            buffer[:] = [g for g in buffer if groups[g]["v"] >= floor]
            st["cancelled"] += len(stale_buffered)
            st["admitted"] -= len(stale_buffered)
        running = {g for g in live if groups[g]["v"] < floor}
        if running and not wave:
            cancel(running)
            st["admitted"] -= len(running)

    def take_batch() -> list[int]:
        """The next step's groups. Without redundancy (the product's rule, docs/async_pipeline.md) a group
        started at v must train by step v + α: the trainer waited until none of those is still generating
        and puts them first, then the earliest finished. With redundancy: the first gps finished."""
        if waits:
            floor = st["version"] - alpha
            due = [g for g in buffer if groups[g]["v"] <= floor]
            order = due + [g for g in buffer if groups[g]["v"] > floor]
        else:
            order = list(buffer)
        batch = order[:gps]
        chosen = set(batch)
        buffer[:] = [g for g in buffer if g not in chosen]
        return batch

    admit()
    dispatch()
    while st["steps"] < num_steps:
        te, ei = min(((e.next_end(), i) for i, e in enumerate(engines)), default=(math.inf, -1))
        tenv = env_heap[0][0] if env_heap else math.inf
        tcl = client[0][0] if client else math.inf
        t = min(te, tenv, tcl, st["train_end"])
        if t == math.inf:
            raise RuntimeError("simulation stalled (engine cap below the group size without replication?)")
        if st["train_end"] == t:
            st["train_end"] = math.inf
            st["version"] += 1
            st["steps"] += 1
            step_ends.append(t)
            expire()
        elif tcl == t:
            queue.append(heapq.heappop(client)[1])
        elif tenv == t:
            rid = heapq.heappop(env_heap)[1]
            if costs.client_per_request_s:
                to_client(rid)
            else:
                queue.insert(0, rid)
        else:
            eng = engines[ei]
            eng.advance(t)
            rid = heapq.heappop(eng.ends)[1]
            r = requests[rid]
            eng.slots -= 1  # one member ended
            r["left_m"] -= 1
            if not r["left_m"]:  # its last member: the request (this turn) is done and frees its slots
                eng.held -= r["w"]
            if r["left_m"]:
                pass  # the request's other members are still decoding
            elif r["turn"] + 1 < work.num_turns:
                r["ctx"] += max(r["segs"][r["turn"]][0]) + work.turn_tokens  # the response, then the env's tokens
                r["turn"] += 1
                latency = r["segs"][r["turn"] - 1][1]
                if wave and env_mode == "batch":
                    r["env_done"] = t + latency
                    pending_env.append(rid)
                else:
                    heapq.heappush(env_heap, (t + latency, rid))
            else:
                r["live"] = False
                g = groups[r["gid"]]
                g["left"] -= 1
                if g["left"] == 0:
                    group_done(r["gid"])
        if pending_env and not queue and not any(e.slots for e in engines) and not env_heap and not client:
            release = max(requests[rid]["env_done"] for rid in pending_env)  # every env steps together
            for rid in pending_env:
                heapq.heappush(env_heap, (release, rid))
            pending_env.clear()
        if (st["train_end"] == math.inf and len(buffer) >= gps and not (colocated and any(e.slots for e in engines))
                and not (waits and any(groups[g]["v"] <= st["version"] - alpha for g in live))):
            batch = take_batch()
            staleness.extend(st["version"] - groups[g]["v"] for g in batch for _ in range(n))
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
                  staleness_mean=sum(staleness) / max(1, len(staleness)), total_s=total,
                  groups_dropped=st["dropped"], groups_cancelled=st["cancelled"])


_MEAN_CACHE: dict[int, tuple[Callable, int, float]] = {}


def _mean_len(work: Workload) -> float:
    """Mean response tokens per sample (all turns), from 4000 draws; cached per sampler. The entry keeps the
    sampler alive so that its id cannot be reused by a later sampler (a stale mean would be returned)."""
    key = id(work.lengths)
    hit = _MEAN_CACHE.get(key)
    if hit is None or hit[0] is not work.lengths or hit[1] != work.num_turns:
        r = random.Random(12345)
        hit = (work.lengths, work.num_turns, sum(work.lengths(r) for _ in range(4000)) / 4000 * work.num_turns)
        _MEAN_CACHE[key] = hit
    return hit[2]


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
