"""The planner's discrete-event simulation of the RL pipeline (`simulate`).

Engines serve requests by processor sharing (engine.py: all sequences in an engine advance one token
per decode step, whose cost depends on how many there are; a virtual clock makes each event O(log n)).
The trainer takes B samples when B are buffered, trains, pushes (V += 1). Admission (admission.py,
the product's rules): sample j may start only when j < (V + 1) · B + ⌊L · B⌋, the lookahead L (batches)
moved after each take (adaptive: whole batches, from min(1, α) up to α while the trainer keeps waiting
for rollout; tokens: a fraction, moved by the waits, the late share of the batch's tokens and idle
engines) or L = α (eager); α = 0 is the synchronous schedule on the same split and the rollout never
waits for anything else. Each trained token's staleness is V − the version of the weights that decoded
it (engine.py: tokens decoded after a push are of the new version, in every pause mode). Expiry, as in
the product: without redundancy a group started at v must train by step v + α, so the trainer waits
while such a group is still generating and puts it first in the batch (a long response delays at most
the step that is due to train it; nothing is discarded; staleness ≤ α).

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
         local engine's HTTP handling, admission and prefill under one GIL); k requests cost k times it
    client_per_request_s: the rollout client handles requests one at a time before they start
    prefill_token_engine_s: engine-exclusive seconds per prefilled token: the prompt, and at each later turn
         the env's appended tokens (prefix_cache) or the whole conversation again (no prefix cache)

One `_Simulation` holds the state of one run; each event handler is a method of it.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random

from megatron_flash.buffer.staleness import late_share
from megatron_flash.planner.admission import DEFAULT_ADMISSION, Admission
from megatron_flash.planner.engine import Engine
from megatron_flash.planner.lengths import mean_len
from megatron_flash.planner.models import Costs, Workload


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
    token_staleness_mean: float = 0.0
    """Per trained token, V − the version whose weights sampled it (engine.py), over every take like
    `staleness_mean` (which counts V − the sample's start version per sample). Token-weighted, as the
    product's `staleness_token_mean`: long responses, often the older ones, count more, so it may
    exceed `staleness_mean` though no token is older than its sample's start."""
    lookahead_mean: float = 0.0
    """Admission lookahead L after each take (admission.py), mean over the steady-state steps."""
    train_wait_s: float = 0.0
    """Seconds a step the trainer waited for rollout (free to take until it took), steady-state mean."""
    takes: list[Take] = dataclasses.field(default_factory=list)
    """Every batch the trainer took, in order."""


@dataclasses.dataclass
class Take:
    """One batch the trainer took."""
    t: float
    version: int
    wait_s: float
    """Seconds from the trainer being free (its last push, or 0) to this take."""
    lookahead: float
    """The admission lookahead (batches) after this take moved it."""
    staleness: float
    """Mean over the batch's samples of V − start version."""
    token_staleness: float
    """Mean over the batch's response tokens of V − the version that sampled each."""


@dataclasses.dataclass
class _Request:
    """One request: `w` sequences (members) of one group, over `num_turns` segments."""
    segs: list[tuple[list[int], float]]
    """Per turn: each member's decode length, then the env latency after the turn."""
    gid: int
    w: int
    turn: int = 0
    left_m: int = 0
    """Members of this turn still decoding."""
    live: bool = True
    ctx: int = 0
    """Tokens of the conversation so far (prompt, responses, env turns)."""
    env_done: float = 0.0
    """Batch env stepping: when this request's own env step would end."""


@dataclasses.dataclass
class _Group:
    v: int
    """Weight version at its start."""
    left: int
    """Requests not finished."""
    keep: bool
    reqs: list[int]
    done: bool = False
    tokens: float = 0.0
    """Response tokens decoded so far (all members, all turns)."""
    arrived: float = 0.0
    """When it finished (reached the buffer, or was dropped)."""
    version_sum: float = 0.0
    """Sum over those tokens of the version that sampled each."""


def simulate(*, work: Workload, costs: Costs, num_engines: int, train_gpus: int, alpha: int, num_steps: int,
             colocated: bool = False, scheduling: str = "queue", prompt_replication: bool = True,
             replication_chunk: int = 0, extra_groups: int = 0, env_mode: str = "async",
             admission: str = DEFAULT_ADMISSION, min_lookahead: float = 1.0, seed: int = 0) -> Result:
    """Simulate `num_steps` train steps; see the module docstring. `colocated`: the same GPUs generate
    then train (synchronous: alpha is 0 and generation waits while the trainer holds the GPUs).
    A group's n responses go out as n requests (prompt_replication), one request of n sequences
    (prompt_replication=False), or requests of `replication_chunk` sequences. `admission`,
    `min_lookahead`: the product's `async_rl.admission` (tokens, adaptive, eager) and
    `async_rl.min_lookahead` (tokens only), admission.py."""
    if scheduling not in ("queue", "batch") or env_mode not in ("async", "batch"):
        raise ValueError(f"scheduling={scheduling!r} / env_mode={env_mode!r}: queue|batch, async|batch")
    if work.batch_size % work.group_size:
        raise ValueError(f"batch_size={work.batch_size} is not a multiple of group_size={work.group_size}")
    if not 0.0 < work.keep_prob <= 1.0:
        raise ValueError(f"keep_prob={work.keep_prob}: must be in (0, 1]")
    sim = _Simulation(work=work, costs=costs, num_engines=num_engines, train_gpus=train_gpus, alpha=alpha,
                      colocated=colocated, scheduling=scheduling, prompt_replication=prompt_replication,
                      replication_chunk=replication_chunk, extra_groups=extra_groups, env_mode=env_mode,
                      admission=admission, min_lookahead=min_lookahead, seed=seed)
    return sim.run(num_steps)


class _Simulation:
    """The state of one `simulate` run: requests, groups, queues, the trainer; one method per event."""

    def __init__(self, *, work: Workload, costs: Costs, num_engines: int, train_gpus: int, alpha: int,
                 colocated: bool, scheduling: str, prompt_replication: bool, replication_chunk: int,
                 extra_groups: int, env_mode: str, admission: str, min_lookahead: float, seed: int) -> None:
        self.work, self.costs, self.train_gpus, self.colocated = work, costs, train_gpus, colocated
        self.extra_groups, self.env_mode = extra_groups, env_mode
        n = work.group_size
        self.rng = random.Random(seed)
        self.alpha = 0 if colocated else alpha
        self.wave = scheduling == "batch" or (env_mode == "batch" and work.num_turns > 1)
        self.gps = work.batch_size // n  # groups per step
        self.admission = Admission(admission=admission, alpha=self.alpha, batch_size=work.batch_size,
                                   min_lookahead=min(min_lookahead, max(self.alpha, 1)))
        self.takes: list[Take] = []
        self.free_at = 0.0  # when the trainer last became free to take a batch
        self.chunk = replication_chunk if replication_chunk > 1 else (1 if prompt_replication else n)
        self.engines = [Engine(costs.decode_step) for _ in range(num_engines)]
        self.requests: list[_Request] = []
        self.groups: list[_Group] = []
        self.queue: list[int] = []
        self.env_heap: list[tuple[float, int]] = []
        self.pending_env: list[int] = []  # batch env stepping: requests waiting for the rest of the wave
        self.buffer: list[int] = []  # finished, kept groups in finish order
        self.client: list[tuple[float, int]] = []  # requests leaving the rollout client: (time, id)
        self.client_free = 0.0
        self.admitted = self.inflight = self.version = self.steps = 0
        self.waves = self.dropped = self.cancelled = 0
        self.train_end = math.inf
        self.train_busy = 0.0
        self.wave_gids: set[int] = set()  # the open wave (batch scheduling)
        self.wave_kept = 0
        self.live: set[int] = set()  # groups generating (not finished, dropped or cancelled)
        self.waits = not self.wave and not extra_groups  # the trainer waits for groups that would expire (take_batch)
        self.step_ends: list[float] = []
        self.staleness: list[int] = []  # per group taken (each of n samples)
        self.token_lag = self.tokens = 0.0  # over every token taken: Σ (V − its version), and how many
        self.mean_tokens = work.prompt_len + mean_len(work)
        self.t = 0.0

    # -- the event loop ---------------------------------------------------------------------------
    def run(self, num_steps: int) -> Result:
        self.admit()
        self.dispatch()
        while self.steps < num_steps:
            self.next_event()
            self.release_env_wave()
            self.maybe_train()
            self.admit()
            self.dispatch()
        return self.result(num_steps)

    def next_event(self) -> None:
        """Advance to the earliest event (a push, a request leaving the client or an env, a member ending)."""
        te, ei = min(((e.next_end(), i) for i, e in enumerate(self.engines)), default=(math.inf, -1))
        tenv = self.env_heap[0][0] if self.env_heap else math.inf
        tcl = self.client[0][0] if self.client else math.inf
        t = self.t = min(te, tenv, tcl, self.train_end)
        if t == math.inf:
            raise RuntimeError("simulation stalled (engine cap below the group size without replication?)")
        if self.train_end == t:
            self.train_end = math.inf
            self.version += 1
            self.steps += 1
            self.step_ends.append(t)
            for e in self.engines:
                e.mark_push(t)
            self.free_at = t
            self.expire()
        elif tcl == t:
            self.queue.append(heapq.heappop(self.client)[1])
        elif tenv == t:
            rid = heapq.heappop(self.env_heap)[1]
            if self.costs.client_per_request_s:
                self.to_client(rid)
            else:
                self.queue.insert(0, rid)
        else:
            self.member_ends(self.engines[ei])

    def member_ends(self, eng: Engine) -> None:
        eng.advance(self.t)
        end, rid, start = heapq.heappop(eng.ends)
        r = self.requests[rid]
        g = self.groups[r.gid]
        g.tokens += end - start
        g.version_sum += eng.version_sum(start, end)
        eng.slots -= 1  # one member ended
        r.left_m -= 1
        if r.left_m:
            return  # the request's other members are still decoding
        eng.held -= r.w  # its last member: the request (this turn) is done and frees its slots
        if r.turn + 1 < self.work.num_turns:
            r.ctx += max(r.segs[r.turn][0]) + self.work.turn_tokens  # the response, then the env's tokens
            r.turn += 1
            latency = r.segs[r.turn - 1][1]
            if self.wave and self.env_mode == "batch":
                r.env_done = self.t + latency
                self.pending_env.append(rid)
            else:
                heapq.heappush(self.env_heap, (self.t + latency, rid))
            return
        r.live = False
        g.left -= 1
        if g.left == 0:
            self.group_done(r.gid)

    def release_env_wave(self) -> None:
        """Batch env stepping: once nothing else is running, every env of the wave steps together."""
        if (self.pending_env and not self.queue and not any(e.slots for e in self.engines) and not self.env_heap
                and not self.client):
            release = max(self.requests[rid].env_done for rid in self.pending_env)
            for rid in self.pending_env:
                heapq.heappush(self.env_heap, (release, rid))
            self.pending_env.clear()

    def maybe_train(self) -> None:
        if (self.train_end == math.inf and len(self.buffer) >= self.gps
                and not (self.colocated and any(e.slots for e in self.engines))
                and not (self.waits and any(self.groups[g].v <= self.version - self.alpha for g in self.live))):
            batch = [self.groups[g] for g in self.take_batch()]
            late = late_share(tokens=[g.tokens for g in batch], arrived=[g.arrived for g in batch], since=self.free_at)
            self.admission.note_take(waited_s=self.t - self.free_at, now=self.t, late=late,
                                     surplus=len(self.buffer) * self.work.group_size)
            tokens = sum(g.tokens for g in batch)
            token_lag = sum(self.version * g.tokens - g.version_sum for g in batch)
            self.token_lag, self.tokens = self.token_lag + token_lag, self.tokens + tokens
            stale = [self.version - g.v for g in batch]
            self.staleness.extend(stale)
            self.takes.append(Take(t=self.t, version=self.version, wait_s=self.t - self.free_at,
                                   lookahead=self.admission.lookahead, staleness=sum(stale) / len(stale),
                                   token_staleness=token_lag / tokens if tokens else 0.0))
            dur = self.costs.train_s(self.train_gpus, int(self.work.batch_size * self.mean_tokens)) + self.costs.sync_s
            self.train_end = self.t + dur
            self.train_busy += dur

    def result(self, num_steps: int) -> Result:
        skip = min(max(self.alpha + 1, num_steps // 3), num_steps - 1)  # steady state: leave out the pipeline fill
        sec = (self.step_ends[-1] - (self.step_ends[skip - 1] if skip else 0.0)) / (num_steps - skip)
        total = self.step_ends[-1]
        for e in self.engines:
            e.advance(total)
        rollout_busy = sum(e.busy_s for e in self.engines) / max(1, len(self.engines)) / total
        train_busy = self.train_busy / total
        if self.colocated:  # the same GPUs: idle when neither generating nor training
            train_idle = rollout_idle = 1 - rollout_busy - train_busy
        else:
            train_idle, rollout_idle = 1 - train_busy, 1 - rollout_busy
        steady = self.takes[skip:num_steps] or self.takes[-1:]
        return Result(sec_per_step=sec, samples_per_s=self.work.batch_size / sec,
                      train_idle_frac=max(0.0, train_idle), rollout_idle_frac=max(0.0, rollout_idle),
                      staleness_mean=sum(self.staleness) / max(1, len(self.staleness)), total_s=total,
                      groups_dropped=self.dropped, groups_cancelled=self.cancelled,
                      token_staleness_mean=self.token_lag / self.tokens if self.tokens else 0.0,
                      lookahead_mean=sum(x.lookahead for x in steady) / len(steady),
                      train_wait_s=sum(x.wait_s for x in steady) / len(steady), takes=self.takes)

    # -- admission and dispatch -------------------------------------------------------------------
    def new_group(self) -> int:
        work, n, rng = self.work, self.work.group_size, self.rng
        samples = [[(max(1, int(work.lengths(rng))), work.env_latency(rng) if k < work.num_turns - 1 else 0.0)
                    for k in range(work.num_turns)] for _ in range(n)]
        gid = len(self.groups)
        keep = work.keep_prob >= 1.0 or rng.random() < work.keep_prob
        ids = []
        for c in range(0, n, self.chunk):  # one request per chunk of members (n sampled sequences)
            part = samples[c:c + self.chunk]
            # each member decodes its own length and leaves the batch when it ends (the engine stops a
            # finished member); the request's turn ends with its longest member, then the slowest env step
            segs = [([x[k][0] for x in part], max(x[k][1] for x in part)) for k in range(work.num_turns)]
            self.requests.append(_Request(segs=segs, gid=gid, w=len(part), ctx=work.prompt_len))
            ids.append(len(self.requests) - 1)
        self.groups.append(_Group(v=self.version, left=len(ids), keep=keep, reqs=ids))
        self.live.add(gid)
        self.admission.on_admit(now=self.t)
        self.inflight += 1
        for rid in ids:
            self.to_client(rid)
        return gid

    def to_client(self, rid: int) -> None:
        """The request passes the rollout client (FIFO, one at a time) before it may start."""
        if not self.costs.client_per_request_s:
            self.queue.append(rid)
            return
        self.client_free = max(self.client_free, self.t) + self.costs.client_per_request_s
        heapq.heappush(self.client, (self.client_free, rid))

    def room(self) -> bool:
        return not self.work.max_inflight_groups or self.inflight < self.work.max_inflight_groups

    def admit(self) -> None:
        if self.colocated and self.train_end < math.inf:
            return
        if self.wave:
            if not self.wave_gids and self.waves * self.work.batch_size < self.admission.limit(self.version):
                self.waves += 1
                self.wave_kept = 0
                self.start_round()
            return
        n = self.work.group_size  # a group is admitted whole, when all n of its samples fit (the product's try_admit)
        while (self.admitted + 1 - self.extra_groups) * n <= self.admission.limit(self.version) and self.room():
            self.new_group()
            self.admitted += 1

    def start_round(self) -> None:
        """Batch scheduling: the step's missing groups (plus redundant ones) start together."""
        for _ in range(self.gps - self.wave_kept + self.extra_groups):
            self.wave_gids.add(self.new_group())

    def dispatch(self) -> None:
        costs, keep = self.costs, []
        for rid in self.queue:
            r = self.requests[rid]
            eng = min(self.engines, key=lambda e: e.held)
            if eng.held and eng.held + r.w > costs.engine_cap:
                keep.append(rid)
                continue
            eng.advance(self.t)
            extra_s = costs.per_request_s + (costs.prefill_s if r.turn == 0 else 0.0)
            pre = extra_s / costs.decode_step(eng.slots + r.w) if extra_s else 0.0
            eng.slots += r.w
            eng.held += r.w  # admitted jointly: all members need a slot, freed when the last ends
            eng.stall += costs.request_engine_s + costs.prefill_token_engine_s * self.prefill_tokens(r)
            r.left_m = r.w
            for length in r.segs[r.turn][0]:
                heapq.heappush(eng.ends, (eng.S + length + pre, rid, eng.S + pre))
        self.queue[:] = keep

    def prefill_tokens(self, r: _Request) -> int:
        """Tokens this turn of the request prefills: the prompt at turn 0; later, what the engine has not
        cached (with a prefix cache the appended env tokens, without it the whole conversation)."""
        if r.turn == 0 or not self.costs.prefix_cache:
            return r.ctx
        return self.work.turn_tokens

    # -- groups finishing, cancelled or expiring, and the trainer's batch -------------------------
    def cancel(self, gids: set) -> None:
        """Abort these groups' requests wherever they are (engine, queue, env wait)."""
        rids = {r for g in gids for r in self.groups[g].reqs if self.requests[r].live}
        for r in rids:
            self.requests[r].live = False
        for e in self.engines:
            if any(x[1] in rids for x in e.ends):
                e.advance(self.t)
                e.ends = [x for x in e.ends if x[1] not in rids]
                heapq.heapify(e.ends)
                e.slots = len(e.ends)  # one entry per member still decoding
                e.held = sum(self.requests[r].w for r in {x[1] for x in e.ends})
        self.queue[:] = [q for q in self.queue if q not in rids]
        self.env_heap[:] = [x for x in self.env_heap if x[1] not in rids]
        heapq.heapify(self.env_heap)
        self.client[:] = [x for x in self.client if x[1] not in rids]
        heapq.heapify(self.client)
        self.pending_env[:] = [q for q in self.pending_env if q not in rids]
        for g in gids:
            if not self.groups[g].done:
                self.groups[g].done = True
                self.live.discard(g)
                self.admission.on_landed(now=self.t, in_flight=len(self.live))
                self.inflight -= 1
                self.cancelled += 1

    def group_done(self, gid: int) -> None:
        g = self.groups[gid]
        g.done, g.arrived = True, self.t
        self.live.discard(gid)
        self.admission.on_landed(now=self.t, in_flight=len(self.live))
        self.inflight -= 1
        if not self.wave:
            if g.keep:
                self.buffer.append(gid)
            else:
                self.dropped += 1
                self.admitted -= 1  # its admission slot goes to a new prompt
            return
        self.wave_gids.discard(gid)
        if not g.keep:
            self.dropped += 1
        elif self.wave_kept < self.gps:
            self.wave_kept += 1
            self.buffer.append(gid)
        if self.wave_kept >= self.gps:
            self.cancel(set(self.wave_gids))  # redundant prompts: abort what is left of the wave
            self.wave_gids = set()
        elif not self.wave_gids:
            self.start_round()  # the filter left the step short: generate the missing groups again

    def expire(self) -> None:
        """After a push: groups that can no longer be trained within α (redundant surplus) go."""
        floor = self.version - self.alpha
        stale_buffered = [g for g in self.buffer if self.groups[g].v < floor]
        if stale_buffered:
            self.buffer[:] = [g for g in self.buffer if self.groups[g].v >= floor]
            self.cancelled += len(stale_buffered)
            self.admitted -= len(stale_buffered)
        running = {g for g in self.live if self.groups[g].v < floor}
        if running and not self.wave:
            self.cancel(running)
            self.admitted -= len(running)

    def take_batch(self) -> list[int]:
        """The next step's groups, as the product's buffer picks them: oldest start version first, then
        the earliest finished. Without redundancy (docs/async_pipeline.md) a group started at v must train
        by step v + α: the trainer waited until none of those is still generating, and being the oldest
        they come first."""
        order = sorted(self.buffer, key=lambda g: self.groups[g].v)  # stable: finish order within a version
        batch = order[:self.gps]
        chosen = set(batch)
        self.buffer[:] = [g for g in self.buffer if g not in chosen]
        return batch
