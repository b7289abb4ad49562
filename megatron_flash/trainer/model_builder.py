"""Build this rank's Megatron-Core `GPTModel` stage for a HF Llama / Qwen2 / Qwen3 config.

The HF config decides the architecture (RMSNorm eps, SwiGLU, RoPE θ, GQA, q/k/v bias, q/k norm,
tied embeddings); the parallel layout decides the shard. Transformer-Engine's layer spec is used
when TE imports and CUDA exists (config `model.use_transformer_engine`), the local spec otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_flash.weight_sync.hf_spec import HFModelSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def padded_vocab_size(vocab_size: int, *, divisible_by: int, tp_size: int) -> int:
    """Megatron pads the vocabulary to a multiple of divisible_by × TP so every rank gets equal rows."""
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


def validate_layout(spec: HFModelSpec, *, tp_size: int, pp_size: int) -> None:
    """Raise ValueError naming the quantity that the layout cannot split evenly."""
    checks = [
        ("num_attention_heads", spec.num_attention_heads, tp_size, "tensor_model_parallel_size"),
        ("num_key_value_heads", spec.num_query_groups, tp_size, "tensor_model_parallel_size"),
        ("intermediate_size", spec.ffn_hidden_size, tp_size, "tensor_model_parallel_size"),
        ("num_hidden_layers", spec.num_layers, pp_size, "pipeline_model_parallel_size"),
    ]
    if pp_size > spec.num_layers:
        raise ValueError(
            f"parallel.pipeline_model_parallel_size={pp_size} is larger than the model's "
            f"num_hidden_layers={spec.num_layers}"
        )
    for what, value, size, key in checks:
        if value % size != 0:
            raise ValueError(f"model {what}={value} is not divisible by parallel.{key}={size}")


def use_te(setting: str) -> bool:
    if setting == "false" or not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        if setting == "true":
            raise ValueError("model.use_transformer_engine=true but transformer_engine does not import")
        return False
    return True


def transformer_config(spec: HFModelSpec, *, tp_size: int, pp_size: int, dtype: str) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    if dtype not in DTYPES:
        raise ValueError(f"model.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    torch_dtype = DTYPES[dtype]
    on_cpu = not torch.cuda.is_available()
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        params_dtype=torch_dtype,
        pipeline_dtype=torch_dtype,
        bf16=torch_dtype == torch.bfloat16,
        fp16=torch_dtype == torch.float16,
        use_cpu_initialization=on_cpu,
        calculate_per_token_loss=True,
        # gloo has no batched P2P with a device sync; plain isend/irecv pairs work everywhere.
        batch_p2p_comm=not on_cpu,
        batch_p2p_sync=not on_cpu,
    )


def build_gpt_stage(spec: HFModelSpec, *, config: Any, make_vocab_size_divisible_by: int,
                    use_transformer_engine: str = "auto") -> Any:
    """This rank's pipeline stage as a GPTModel (parallel output: logits stay vocab-sharded)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel

    if use_te(use_transformer_engine):
        layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm)
    else:
        layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=spec.qk_norm)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(spec.vocab_size, divisible_by=make_vocab_size_divisible_by,
                                     tp_size=config.tensor_model_parallel_size),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta),
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def layer_offset(spec: HFModelSpec, *, pp_rank: int, pp_size: int) -> int:
    """Global index of this stage's first layer (stages number their layers from 0)."""
    return pp_rank * (spec.num_layers // pp_size)
