"""Capacity planner: stage cost models and a discrete-event simulation of the RL pipeline (pure Python).

No Megatron, no torch, nothing else of megatron_flash: `tools/plan_resources.py` is the CLI. The
question it answers: for a model, a response-length distribution and G GPUs, how many GPUs should
generate and how many train, and what does asynchrony buy over synchronous colocated training?

    models.py      what each stage costs: GPU table, model and workload shapes, `Costs`
    simulation.py  `simulate`: engines, scheduling, replication, filters, envs, the trainer's takes
    fleet.py       step time vs rollout fleet size, and how many rollout nodes to add (the elastic fleet)
    admission.py   the product's admission rule: lookahead L (adaptive or eager, ≤ α) moved after each take
    engine.py      processor-sharing engine clock; which weight version decoded each token
    lengths.py     response-length samplers and measured lengths read from run outputs

Worked example (tests/unit/test_planner.py): two stages of 1 s each, constant lengths, α ≥ 1 →
1 s/step vs 2 s/step synchronous: speedup 2, the ceiling for two balanced stages.
"""

from megatron_flash.planner.admission import ADMISSIONS, DEFAULT_ADMISSION
from megatron_flash.planner.fleet import AddNodes, FleetPoint, add_nodes, fleet_point, join_push_s, settle
from megatron_flash.planner.lengths import (empirical_lengths, inv_k_lengths, lognormal_lengths, mean_len,
                                            read_lengths_file)
from megatron_flash.planner.models import GPU_TABLE, Costs, GPUSpec, ModelSpec, Workload, measured_decode
from megatron_flash.planner.simulation import Result, Take, simulate

_mean_len = mean_len  # the name tools/plan_resources.py and tools/validate_planner.py call

__all__ = ["ADMISSIONS", "DEFAULT_ADMISSION", "GPU_TABLE", "AddNodes", "Costs", "FleetPoint", "GPUSpec", "ModelSpec",
           "Result", "Take", "Workload", "add_nodes", "empirical_lengths", "fleet_point", "inv_k_lengths",
           "join_push_s", "lognormal_lengths", "mean_len", "measured_decode", "read_lengths_file", "settle",
           "simulate"]
