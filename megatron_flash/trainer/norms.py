"""RMSNorm for Megatron's local (non-Transformer-Engine) layer spec that also runs under sequence
parallelism.

Megatron-Core's local spec uses `WrappedTorchNorm`, which refuses `sequence_parallel` because torch's
norm does not mark its weight for the extra gradient reduction; Apex's fused norm does. Under sequence
parallelism every TP rank normalises its own slice of the tokens (the computation per token is the
same), so each rank's weight gradient covers only its tokens: Megatron sums the gradients of
parameters marked `sequence_parallel` over the TP group (finalize_model_grads). This norm sets that
mark, so the local spec can train with sequence parallelism on CPU and on GPUs without TE or Apex.
MoE layers need this: Megatron refuses to train MoE with TP > 1 without sequence parallelism.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


class RMSNorm(torch.nn.RMSNorm):
    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm") -> None:
        if config.normalization != "RMSNorm":
            raise ValueError(f"megatron_flash's local norm is RMSNorm only, got {config.normalization!r}")
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ValueError("zero-centred gamma and memory-efficient norms need Transformer Engine or Apex")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)


def local_block_spec(layer_spec: Any, config: Any, *, vp_stage: Optional[int]) -> Any:
    """This stage's transformer block for the local layer spec, with this module's RMSNorm wherever
    the spec would use torch's (`WrappedTorchNorm`: Apex absent), per layer and final."""
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    sub, attention = layer_spec.submodules, layer_spec.submodules.self_attention.submodules
    for owner, name in ((sub, "input_layernorm"), (sub, "pre_mlp_layernorm"), (attention, "q_layernorm"),
                        (attention, "k_layernorm")):
        if getattr(owner, name, None) is WrappedTorchNorm:
            setattr(owner, name, RMSNorm)
    final = RMSNorm if transformer_block.LayerNormImpl is WrappedTorchNorm else transformer_block.LayerNormImpl
    layers = transformer_block.get_num_layers_to_build(config, vp_stage=vp_stage)
    return transformer_block.TransformerBlockSubmodules(layer_specs=[layer_spec] * layers, layer_norm=final)
