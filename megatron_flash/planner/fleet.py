"""Fleet size: what more rollout engines buy a running job (the elastic fleet: engines from other allocations
join it), on the simulation's own model. The trainer keeps its GPUs; the fleet has `engines` engines of
engine_tp GPUs, `engines_per_node` to a node. Per fleet size (`fleet_point`):

    rollout_s  the rollout's own pace, seconds per batch: `simulate` at the same α and admission with the train
               step and the push free (what the engines, the client and the stragglers due allow)
    train_s    the train step on B · (prompt + mean response) tokens (`Costs.train_s`, as the simulation charges it)
    push_s     the weight push each step: `Costs.sync_s` + push_s_per_engine · engines
    step_s     `simulate` with every cost: the trainer trains, then pushes, so step_s ≥ train_s + push_s (the
               floor no fleet beats), and ≈ max(rollout_s, train_s + push_s) plus waits for due stragglers
    wait_s     step_s − train_s − push_s: the trainer's wait for rollout a step
    bound      "rollout" when the trainer waits more than 1 % of its own time (wait_s > 0.01 · (train_s +
               push_s)), else "train". Rollout-bound with rollout_s below the trainer's time: what holds the
               trainer is the admission lookahead or a straggler due, not the fleet's throughput

How many nodes to add (`add_nodes`): s(k) is step_s with k more nodes. The answer is the smallest k beyond
which no larger fleet is more than X faster: s(k') ≥ (1 − X) · s(k) for every k' > k (`settle`). The scan
stops once s(k*) · (1 − X) ≤ the trainer's floor (train_s + push_s, never lower for a larger fleet), so no
further node can change the answer (converged); else at `max_add` nodes, and the answer holds over the
scanned range only (the fleet still gaining at the cap, or something other than its size holding the rollout
back: the client, stragglers due, the admission lookahead).

Weight pushes. broadcast (NCCL) and disk reach every engine in one push, so the push per step is the same
for any fleet (push_s_per_engine 0, the default; give it where a push's cost grows with the engines). An
engine that joins gets the whole weights once, with the next push (rollout/fleet.py: a full push, deltas
after): `join_push_s` = weight bytes / link + the sync overhead, added to that one step, not simulated.
Worked example (tests/unit/test_planner_fleet.py): engines of 16 slots, 100-token responses at 10 ms a
decode step, B = 64, train 1 s + push 0.5 s, eager admission at α = 4: 4, 2, then train-bound 1.5 s a step
with 1, 2, 3 engines.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

from megatron_flash.planner.lengths import mean_len
from megatron_flash.planner.models import Costs, GPUSpec, ModelSpec, Workload
from megatron_flash.planner.simulation import simulate

BOUND_WAIT = 0.01
"""Rollout-bound: the trainer waits more than this share of its own step (train + push) for rollout."""


@dataclasses.dataclass
class FleetPoint:
    engines: int
    nodes: int
    """Nodes that host them: ⌈engines / engines_per_node⌉."""
    rollout_s: float
    train_s: float
    push_s: float
    step_s: float
    samples_per_s: float
    wait_s: float
    bound: str
    """"rollout" (the trainer waits more than 1 % of train_s + push_s) or "train"."""


@dataclasses.dataclass
class AddNodes:
    current_engines: int
    engines_per_node: int
    threshold: float
    """X: a fraction (0.05 = 5 %)."""
    add_nodes: int
    """The answer: nodes to add (0: more nodes buy at most X)."""
    engines: int
    """The fleet then: current_engines + add_nodes · engines_per_node."""
    step_s: float
    base_step_s: float
    """Step time of the current fleet."""
    speedup: float
    floor_s: float
    """train_s + push_s of the largest fleet scanned: no larger fleet steps faster."""
    converged: bool
    scanned: list[FleetPoint]
    """Fleets of current_engines + k · engines_per_node engines, k = 0, 1, ... (the scan)."""
    join_push_s: float = 0.0

    @property
    def fastest(self) -> int:
        """k of the fastest fleet scanned (the answer's gain is at most X short of it)."""
        return min(range(len(self.scanned)), key=lambda k: self.scanned[k].step_s)


def trainer_s(work: Workload, costs: Costs, train_gpus: int) -> float:
    """The train step the simulation charges (simulation.py `maybe_train`), without the push."""
    return costs.train_s(train_gpus, int(work.batch_size * (work.prompt_len + mean_len(work))))


def join_push_s(model: ModelSpec, gpu: GPUSpec, sync_overhead_s: float) -> float:
    """One whole push to engines that join (`Costs.from_models`' sync with deltas off)."""
    return model.push_bytes() / (gpu.link_gbs * 1e9) + sync_overhead_s


def fleet_point(*, work: Workload, costs: Costs, engines: int, train_gpus: int, engines_per_node: int,
                alpha: int, num_steps: int, push_s_per_engine: float = 0.0, **sim) -> FleetPoint:
    """One fleet size; `sim`: simulate's other keywords (scheduling, admission, seed, ...)."""
    if engines < 1 or engines_per_node < 1 or train_gpus < 1:
        raise ValueError(f"engines={engines}, engines_per_node={engines_per_node}, train_gpus={train_gpus}: "
                         "each must be ≥ 1")
    push = costs.sync_s + push_s_per_engine * engines
    full = dataclasses.replace(costs, sync_s=push)
    free = dataclasses.replace(costs, sync_s=0.0, train_s=lambda g, tokens: 0.0)
    kw = dict(work=work, num_engines=engines, train_gpus=train_gpus, alpha=alpha, num_steps=num_steps, **sim)
    step = simulate(costs=full, **kw).sec_per_step
    rollout = simulate(costs=free, **kw).sec_per_step
    train = trainer_s(work, costs, train_gpus)
    wait = max(0.0, step - train - push)
    return FleetPoint(engines=engines, nodes=math.ceil(engines / engines_per_node), rollout_s=rollout,
                      train_s=train, push_s=push, step_s=step, samples_per_s=work.batch_size / step, wait_s=wait,
                      bound="rollout" if wait > BOUND_WAIT * (train + push) else "train")


def settle(steps: list[float], floor: float, threshold: float) -> tuple[int, bool]:
    """The smallest k with steps[k'] ≥ (1 − threshold) · steps[k] for every k' > k in the list, and whether
    it is final: steps[k] · (1 − threshold) ≤ floor, the least step time any larger fleet can have."""
    if not steps or not 0.0 < threshold < 1.0:
        raise ValueError(f"settle: steps={steps!r}, threshold={threshold!r} (a fraction in (0, 1))")
    best_after = math.inf  # the least step time after k
    answer = len(steps) - 1
    for k in range(len(steps) - 1, -1, -1):
        if best_after >= (1.0 - threshold) * steps[k]:
            answer = k
        best_after = min(best_after, steps[k])
    return answer, steps[answer] * (1.0 - threshold) <= floor


def add_nodes(point: Callable[[int], FleetPoint], *, current_engines: int, engines_per_node: int,
              threshold: float = 0.05, max_add: int = 16, join_s: Optional[float] = None) -> AddNodes:
    """Scan k = 0, 1, ... max_add extra nodes (`point(engines)` → FleetPoint) until the answer is final."""
    if current_engines < 1 or engines_per_node < 1 or max_add < 1:
        raise ValueError(f"current_engines={current_engines}, engines_per_node={engines_per_node}, "
                         f"max_add={max_add}: each must be ≥ 1")
    scanned: list[FleetPoint] = []
    for k in range(max_add + 1):
        scanned.append(point(current_engines + k * engines_per_node))
        floor = scanned[-1].train_s + scanned[-1].push_s
        answer, converged = settle([p.step_s for p in scanned], floor, threshold)
        if converged:
            break
    chosen, base = scanned[answer], scanned[0]
    return AddNodes(current_engines=current_engines, engines_per_node=engines_per_node, threshold=threshold,
                    add_nodes=answer, engines=chosen.engines, step_s=chosen.step_s, base_step_s=base.step_s,
                    speedup=base.step_s / chosen.step_s, floor_s=floor, converged=converged, scanned=scanned,
                    join_push_s=join_s or 0.0)
