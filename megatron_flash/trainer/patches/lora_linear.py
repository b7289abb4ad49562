"""Patch: a LoRA term on Megatron-Core's parallel linears, by changing each target linear's class.

  replaces   the class of each adapted ColumnParallelLinear / RowParallelLinear instance
             (`linear.__class__`) with a subclass that adds s·B·(A·x) to its forward and the
             adapters to its `sharded_state_dict` (which extends the base's: Megatron's entries for
             W and its bias, then A and B sharded along their own TP axes)
  why        the model is built from the layer spec before the base weights and the adapters are
             known (the adapters' shards come from a PEFT file or a seed after the base loads), and
             an adapted linear must keep everything Megatron's own does (its weight's name, its
             buckets, its frozen-weight path); a subclass swapped in then is the one way to add a
             term to `forward` without a second module in the graph. Megatron has no LoRA
             extension point on its local spec
  versions   megatron-core 0.16.1 and 0.19.2 (tested); apply_swiglu_sharded_factory's keyword
             arguments differ between them (read from its signature)
  checked    `check()` at start-up: ColumnParallelLinear / RowParallelLinear have forward and
             sharded_state_dict(prefix, sharded_offsets, metadata), and the factory imports
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from megatron_flash.trainer.patches.base import PatchMismatch


def adapt(linear: Any, *, column: bool) -> None:
    """Give `linear` (a column- or row-parallel linear) the LoRA class of its base class."""
    linear.__class__ = _adapter_class(type(linear), column)


@functools.lru_cache(maxsize=None)
def _adapter_class(base: type, column: bool) -> type:
    """`base` (ColumnParallelLinear, RowParallelLinear) with a LoRA term; one class per base and kind."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    axes = {"lora_b": 0} if column else {"lora_a": 1}  # the split factor; the other is whole on every rank

    class Adapted(base):  # type: ignore[misc, valid-type]
        """`base` with a LoRA term; see the module docstring."""

        def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            output, bias = base.forward(self, input_, *args, **kwargs)
            if self.lora_active:
                output = output + self.lora_delta(input_)
            return output, bias

        def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
            if self.lora_dropout and self.training and torch.is_grad_enabled():
                if column and not self.sequence_parallel:  # x is the same on every TP rank: so must its mask be
                    x = torch.nn.functional.dropout(x, p=self.lora_dropout)
                else:  # each rank holds its own part of x: masks of its own (Megatron's TP-rank streams)
                    with tensor_parallel.get_cuda_rng_tracker().fork():
                        x = torch.nn.functional.dropout(x, p=self.lora_dropout)
            h = torch.nn.functional.linear(x, self.lora_a)
            group = self.tp_group
            if column:  # h must be whole on every rank before B's rows; its gradient summed over TP
                h = (mappings.gather_from_sequence_parallel_region(h, group=group) if self.sequence_parallel
                     else mappings.copy_to_tensor_model_parallel_region(h, group=group))
            else:  # partial sums over the input's TP split
                h = (mappings.reduce_scatter_to_sequence_parallel_region(h, group=group) if self.sequence_parallel
                     else mappings.reduce_from_tensor_model_parallel_region(h, group=group))
            return torch.nn.functional.linear(h, self.lora_b) * self.lora_scaling

        def lora_merged_weight(self) -> torch.Tensor:
            """This rank's shard of W + s·B·A, formed in float32 and cast once to W's dtype (a
            bfloat16 merge loses the small update against W's rounding)."""
            delta = self.lora_b.detach().float() @ self.lora_a.detach().float()
            return (self.weight.detach().float() + self.lora_scaling * delta).to(self.weight.dtype)

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: Any = (), metadata: Any = None) -> Any:
            """Megatron's entries (W, its bias), then the adapters' with their own TP axes: the base
            method shards only weight and bias and would save A and B as if replicated."""
            out = base.sharded_state_dict(self, prefix, sharded_offsets, metadata)
            adapters = {name: getattr(self, name) for name in ("lora_a", "lora_b")}
            out.update(make_sharded_tensors_for_checkpoint(adapters, prefix, axes, sharded_offsets,
                                                           tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]))
            if self.lora_gate_up:  # B's rows are [gate_r; up_r] per rank, like W's: the MLP's factory for W
                out[f"{prefix}lora_b"] = _swiglu_factory(out[f"{prefix}lora_b"], sharded_offsets, metadata,
                                                         self.tp_group)
            return out

    Adapted.__name__ = Adapted.__qualname__ = f"LoRA{base.__name__}"
    return Adapted


def _swiglu_factory(sharded: Any, sharded_offsets: Any, metadata: Any, tp_group: Any) -> Any:
    """Megatron's checkpoint factory for a SwiGLU fc1 tensor (each TP shard is two slices of the full
    [gate; up]); its keyword arguments differ between megatron-core versions."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    params = inspect.signature(apply_swiglu_sharded_factory).parameters
    kwargs = {k: v for k, v in (("tp_group", tp_group), ("dp_group", metadata["dp_cp_group"])) if k in params}
    return apply_swiglu_sharded_factory(sharded, sharded_offsets, (metadata or {}).get("singleton_local_shards", False),
                                        **kwargs)


def check() -> None:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    try:
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory  # noqa: F401
    except ImportError as error:
        raise PatchMismatch("transformer.mlp.apply_swiglu_sharded_factory", f"does not import ({error})") from None
    for cls in (ColumnParallelLinear, RowParallelLinear):
        params = list(inspect.signature(cls.sharded_state_dict).parameters)[1:4]
        if params != ["prefix", "sharded_offsets", "metadata"]:
            raise PatchMismatch(f"{cls.__name__}.sharded_state_dict", f"takes {params}; patches/lora_linear.py "
                                "extends (prefix, sharded_offsets, metadata)")
