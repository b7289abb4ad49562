"""Rows whose attention is not plain causal per segment carry their plan with them, typed.

Two kinds of packed row need one: a shared-prefix row (each response attends to [its prompt; its
own tokens], trainer/shared_prefix.py) and a context-parallel row (each local chunk attends to the
keys of its sequence, all-gathered over the CP group, up to its own end, trainer/context_parallel.py).
Both hand the core attention the same two plans, built on the host with the micro-batch:

  local   (packed_attention.py) per shape: query indices [sq, b], key indices [sk, b] and a
          bottom-right causal mask [sq, sk] (True = masked)
  flash   (flash_attention.py) cu_q, cu_k (int32), key indices, max_q, max_k: torch's varlen
          attention with the queries' and the keys' offsets apart

They travel as fields of a subclass of Megatron's PackedSeqParams, the object Megatron passes to the
core attention; `cp_group` set means the key indices point into K/V all-gathered over that group.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import torch


@functools.lru_cache(maxsize=None)
def planned_params_class() -> type:
    """Megatron's PackedSeqParams with a row's attention plans as typed fields."""
    from megatron.core.packed_seq_params import PackedSeqParams

    @dataclasses.dataclass
    class PlannedParams(PackedSeqParams):
        local_plan: Optional[list] = None
        """[(q_index [sq, b], k_index [sk, b], mask [sq, sk] | None)] (packed_attention.py)."""
        flash_plan: Optional[dict] = None
        """cu_q, cu_k, k_index, max_q, max_k (flash_attention.py)."""
        kv_group: Any = None
        """Context parallelism: K and V are all-gathered over this group before the plan indexes them."""

    return PlannedParams


def with_plan(params: Any, *, local_plan: list, flash_plan: dict, device: torch.device, kv_group: Any = None) -> Any:
    """`params` (a PackedSeqParams) as a PlannedParams carrying the plans, moved to `device`."""
    return planned_params_class()(
        **{f.name: getattr(params, f.name) for f in dataclasses.fields(params)},
        local_plan=[(q.to(device), k.to(device), None if m is None else m.to(device)) for q, k, m in local_plan],
        flash_plan={key: v.to(device) if torch.is_tensor(v) else v for key, v in flash_plan.items()},
        kv_group=kv_group)


def plan_of(params: Any) -> Optional[Any]:
    """The PlannedParams of a planned row; None for a plain packed row."""
    return params if isinstance(params, planned_params_class()) else None


def keys_and_values(key: torch.Tensor, value: torch.Tensor, plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V the plan's key indices point into: this rank's, or all-gathered over the CP group
    (the backward reduce-scatters their gradients: every rank's queries used them)."""
    if plan.kv_group is None:
        return key, value
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    gather = functools.partial(gather_from_sequence_parallel_region, tensor_parallel_output_grad=True,
                               group=plan.kv_group)
    return gather(key.contiguous()), gather(value.contiguous())
