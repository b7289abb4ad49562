"""Patch: megatron-core 0.16's distributed optimizer, fully-reshardable load with torch Adam.

  replaces   DistributedOptimizer._set_main_param_and_optimizer_states(model_param, tensors), on
             the optimizer object being loaded (its own method, wrapped; the class is untouched)
  why        without TE/Apex Adam (CPU, or GPUs without TE) the load leaves each parameter's `step`
             out of the tensors it read (it restores `step` separately) but then copies every key of
             the live state, `step` included, from them: KeyError 'step'. The wrapper hides `step`
             during that copy, per parameter
  versions   megatron-core 0.16.1 (needed) and 0.19.2 (harmless)
  checked    `check()` at start-up: the method exists and takes (model_param, tensors)
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from megatron_flash.trainer.patches.base import PatchMismatch


def adam_optimizers(optimizer: Any) -> list[Any]:
    """(Megatron optimizer, its torch Adam/AdamW) pairs of a (chained) Megatron optimizer."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            out.append((opt, inner))
    return out


def skip_step_on_reshardable_load(optimizer: Any) -> None:
    """Work around megatron-core 0.16 with torch Adam (no TE/Apex: CPU, or GPUs without TE): the
    distributed optimizer's fully-reshardable load leaves each parameter's `step` out of the tensors
    it read (it restores `step` separately) but then copies *every* key of the live state — `step`
    included — from them (KeyError 'step'). Per parameter, hide `step` during that copy."""
    for opt, inner in adam_optimizers(optimizer):
        if type(opt).__name__ != "DistributedOptimizer" or getattr(opt, "_mf_step_patch", False):
            continue
        original = opt._set_main_param_and_optimizer_states

        def copy_without_step(model_param: Any, tensors: dict, _opt: Any = opt, _inner: Any = inner,
                              _original: Any = original) -> None:
            group_index, group_order = _opt.model_param_group_index_map[model_param]
            state = _inner.state[_inner.param_groups[group_index]["params"][group_order]]
            step = state.pop("step", None) if "step" not in tensors else None
            try:
                _original(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        opt._set_main_param_and_optimizer_states = copy_without_step
        opt._mf_step_patch = True


def check() -> None:
    from megatron.core.optimizer import distrib_optimizer

    cls = getattr(distrib_optimizer, "DistributedOptimizer", None)
    fn = getattr(cls, "_set_main_param_and_optimizer_states", None)
    if fn is None:
        raise PatchMismatch("DistributedOptimizer._set_main_param_and_optimizer_states",
                            "missing; patches/optimizer_load.py wraps it on a reshardable load")
    params = [p for p in inspect.signature(fn).parameters if p != "self"]
    if params != ["model_param", "tensors"]:
        raise PatchMismatch("DistributedOptimizer._set_main_param_and_optimizer_states",
                            f"takes {params}, patches/optimizer_load.py wraps (model_param, tensors)")
