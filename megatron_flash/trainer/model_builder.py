"""Build this rank's Megatron-Core `GPTModel` stage for a HF Llama / Qwen2 / Qwen3 / Qwen3-MoE config.

The HF config decides the architecture (RMSNorm eps, SwiGLU, RoPE θ, GQA, q/k/v bias, q/k norm,
tied embeddings, experts and router); the parallel layout decides the shard. MoE layers use
Megatron's top-k router in fp32 (softmax over the top-k logits = Qwen3's softmax, top-k, renormalise;
softmax before top-k when the checkpoint does not renormalise) and SequentialMLP experts. Transformer-Engine's layer spec is used
when TE imports and CUDA exists (config `model.use_transformer_engine`), unless an enabled option runs on
the local spec only (LoRA, shared prefixes, a named attention backend: `resolve_te`); the local spec otherwise.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

from megatron_flash.hf.spec import HFModelSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def padded_vocab_size(vocab_size: int, *, divisible_by: int, tp_size: int) -> int:
    """Megatron pads the vocabulary to a multiple of divisible_by × TP so every rank gets equal rows."""
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class MoEOptions:
    """Trainer options for MoE models (config `parallel.expert_*`, `model.moe_*`)."""

    ep_size: int = 1
    etp_size: Optional[int] = None  # None = the TP size
    aux_loss_coeff: Optional[float] = None  # None = the checkpoint's router_aux_loss_coef
    token_dispatcher: str = "auto"  # auto = alltoall with CUDA, allgather without
    routing_replay: bool = False  # route every token as the engine did (trainer.moe_routing_replay=rollout)


def validate_layout(spec: HFModelSpec, *, tp_size: int, pp_size: int, vpp_size: Optional[int] = None,
                    moe: MoEOptions = MoEOptions(), sequence_parallel: bool = False,
                    recompute: str = "none") -> None:
    """Raise ValueError naming the quantity that the layout cannot split evenly."""
    checks = [
        ("num_attention_heads", spec.num_attention_heads, tp_size, "tensor_model_parallel_size"),
        ("num_key_value_heads", spec.num_query_groups, tp_size, "tensor_model_parallel_size"),
        ("num_hidden_layers", spec.num_layers, pp_size, "pipeline_model_parallel_size"),
    ]
    if spec.moe is None:
        checks.append(("intermediate_size", spec.ffn_hidden_size, tp_size, "tensor_model_parallel_size"))
        for key, value, default in (("expert_model_parallel_size", moe.ep_size, 1),
                                    ("expert_tensor_parallel_size", moe.etp_size, None)):
            if value != default:
                raise ValueError(f"parallel.{key}={value} needs a mixture-of-experts model; "
                                 f"{spec.architecture} is dense")
        if moe.aux_loss_coeff is not None:
            raise ValueError(f"model.moe_aux_loss_coeff={moe.aux_loss_coeff} needs a mixture-of-experts model; "
                             f"{spec.architecture} is dense")
        if moe.routing_replay:
            raise ValueError(f"trainer.moe_routing_replay=rollout needs a mixture-of-experts model; "
                             f"{spec.architecture} is dense")
    else:
        etp = tp_size if moe.etp_size is None else moe.etp_size
        dispatcher = moe_dispatcher(moe)
        if dispatcher == "alltoall" and not torch.cuda.is_available():
            raise ValueError("model.moe_token_dispatcher=alltoall needs CUDA (megatron-core's all-to-all "
                             "dispatcher uses CUDA streams); use allgather on CPU")
        if moe.routing_replay and recompute == "full" and pp_size > 1:
            # Megatron-Core 0.16 never switches its routers to REPLAY_BACKWARD: a layer re-run in the
            # backward of a pipelined schedule would take a later micro-batch's routes.
            raise ValueError("trainer.moe_routing_replay=rollout with trainer.recompute=full and "
                             f"parallel.pipeline_model_parallel_size={pp_size} would replay the wrong "
                             "micro-batch's routes in recomputed layers; use trainer.recompute=selective or none")
        if tp_size > 1 and not sequence_parallel:  # Megatron's MoE layer refuses to train otherwise
            raise ValueError(f"parallel.tensor_model_parallel_size={tp_size} with a mixture-of-experts model needs "
                             "parallel.sequence_parallel=true")
        checks += [("num_experts", spec.moe.num_experts, moe.ep_size, "expert_model_parallel_size"),
                   ("moe_intermediate_size", spec.moe.ffn_hidden_size, etp, "expert_tensor_parallel_size")]
    if pp_size > spec.num_layers:
        raise ValueError(
            f"parallel.pipeline_model_parallel_size={pp_size} is larger than the model's "
            f"num_hidden_layers={spec.num_layers}"
        )
    for what, value, size, key in checks:
        if value % size != 0:
            raise ValueError(f"model {what}={value} is not divisible by parallel.{key}={size}")
    if vpp_size is not None and spec.num_layers % (pp_size * vpp_size):
        raise ValueError(
            f"model num_hidden_layers={spec.num_layers} is not divisible by "
            f"parallel.pipeline_model_parallel_size × parallel.virtual_pipeline_model_parallel_size "
            f"= {pp_size} × {vpp_size}"
        )


def check_scale_options(scale: "ScaleOptions", *, optimizer: Any, uses_te: bool, moe: bool = False) -> None:
    """Options the installed stack cannot honour are errors here, never silently dropped."""
    cp = scale.context_parallel_size
    if cp > 1 and uses_te:  # resolve_te takes the local spec for CP unless told true (refused there)
        raise ValueError(f"parallel.context_parallel_size={cp} runs on the local layer spec; Transformer Engine's "
                         "is in use")
    if cp > 1 and moe:
        raise ValueError(f"parallel.context_parallel_size={cp} with a mixture-of-experts model is not built (the "
                         "routers' load balancing and routing replay count each rank's chunks)")
    if getattr(optimizer, "cpu_offload_fraction", 0.0) > 0 and not torch.cuda.is_available():
        raise ValueError(
            "optimizer.cpu_offload_fraction > 0 needs CUDA: a CPU trainer already keeps the optimizer in "
            "CPU memory"
        )


def local_spec_reasons(*, lora_rank: int = 0, shared_prefix: bool = False, attention_backend: str = "auto",
                       context_parallel_size: int = 1) -> list[str]:
    """The enabled options that run on the local (TE-free) layer spec only, each named by its key."""
    reasons = []
    if context_parallel_size > 1:  # the local spec's attention gathers K/V over the CP group itself
        reasons.append(f"parallel.context_parallel_size={context_parallel_size}")
    if lora_rank:  # adapters wrap Megatron's own parallel linears; TE fuses norm + linear
        reasons.append(f"model.lora.rank={lora_rank}")
    if shared_prefix:  # TE's packed attention has no prompt-to-response mask
        reasons.append("trainer.shared_prefix=true")
    if attention_backend != "auto":  # a core attention of the local spec, asked for by name
        reasons.append(f"model.attention_backend={attention_backend}")
    return reasons


def te_importable() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_te(setting: str, *, local_only: Sequence[str] = ()) -> tuple[bool, str]:
    """(whether Transformer Engine's layer spec is used, a start-up line saying why not when auto
    would have taken it) for model.use_transformer_engine=`setting`. `local_only` names the enabled
    options that need the local spec (local_spec_reasons): auto then takes the local spec, true is
    refused by name. ValueError when the setting cannot run here."""
    if setting == "false":
        return False, ""
    cuda = torch.cuda.is_available()
    if setting == "true":
        if not cuda:
            raise ValueError("model.use_transformer_engine=true needs CUDA (Transformer Engine's layers are CUDA "
                             "only); use auto or false")
        if not te_importable():
            raise ValueError("model.use_transformer_engine=true but transformer_engine does not import")
        if local_only:
            raise ValueError(f"model.use_transformer_engine=true with {', '.join(local_only)}: "
                             "these run on the local layer spec only; use model.use_transformer_engine=auto or false")
        return True, ""
    if not cuda or not te_importable():
        return False, ""
    if local_only:
        return False, (f"model.use_transformer_engine=auto: Transformer Engine is installed, but "
                       f"{', '.join(local_only)} run on the local layer spec only; using the local spec")
    return True, ""


def use_te(setting: str) -> bool:
    """resolve_te with no option that needs the local spec."""
    return resolve_te(setting)[0]


@dataclasses.dataclass(frozen=True)
class ScaleOptions:
    """The parallel and memory options that reach TransformerConfig (config sections `parallel`,
    `trainer.recompute*`)."""

    sequence_parallel: bool = False
    virtual_pipeline_size: Optional[int] = None
    context_parallel_size: int = 1
    recompute: str = "none"  # none | selective | full
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1

    def config_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(
            sequence_parallel=self.sequence_parallel,
            virtual_pipeline_model_parallel_size=self.virtual_pipeline_size,
            context_parallel_size=self.context_parallel_size,
        )
        if self.recompute == "selective":
            kwargs.update(recompute_granularity="selective")
        elif self.recompute == "full":
            kwargs.update(recompute_granularity="full", recompute_method=self.recompute_method,
                          recompute_num_layers=self.recompute_num_layers)
        return kwargs


def moe_dispatcher(moe: MoEOptions) -> str:
    if moe.token_dispatcher == "auto":
        return "alltoall" if torch.cuda.is_available() else "allgather"
    return moe.token_dispatcher


def moe_config_kwargs(spec: HFModelSpec, moe: MoEOptions) -> dict[str, Any]:
    """TransformerConfig's MoE fields (none for a dense model)."""
    if spec.moe is None:
        return {}
    m = spec.moe
    return dict(
        num_moe_experts=m.num_experts,
        moe_router_topk=m.top_k,
        moe_ffn_hidden_size=m.ffn_hidden_size,
        moe_router_score_function="softmax",
        # Top-k of the logits then softmax over those k = softmax, top-k, renormalise (Qwen3's
        # norm_topk_prob); without renormalisation the softmax runs over every expert first.
        moe_router_pre_softmax=not m.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=m.aux_loss_coef if moe.aux_loss_coeff is None else moe.aux_loss_coeff,
        moe_router_dtype="fp32",
        moe_token_dispatcher_type=moe_dispatcher(moe),
        moe_grouped_gemm=False,
        # Every MoE model gets Megatron's router replay hooks (idle unless targets are set): routing
        # agreement with the engine is measured with replay off too.
        moe_enable_routing_replay=True,
        expert_model_parallel_size=moe.ep_size,
        expert_tensor_parallel_size=moe.etp_size,
    )


def transformer_config_kwargs(spec: HFModelSpec, *, tp_size: int, pp_size: int, dtype: str,
                              scale: ScaleOptions = ScaleOptions(), moe: MoEOptions = MoEOptions()) -> dict[str, Any]:
    """Everything Megatron's TransformerConfig receives (no Megatron import: testable as data)."""
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    torch_dtype = DTYPES[dtype]
    on_cpu = not torch.cuda.is_available()
    return dict(
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
        **scale.config_kwargs(),
        **moe_config_kwargs(spec, moe),
    )


def transformer_config(spec: HFModelSpec, *, tp_size: int, pp_size: int, dtype: str,
                       scale: ScaleOptions = ScaleOptions(), moe: MoEOptions = MoEOptions()) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**transformer_config_kwargs(spec, tp_size=tp_size, pp_size=pp_size, dtype=dtype,
                                                         scale=scale, moe=moe))


def build_gpt_stage(spec: HFModelSpec, *, config: Any, make_vocab_size_divisible_by: int,
                    transformer_engine: bool = False, attention: str = "local",
                    vp_stage: Optional[int] = None) -> Any:
    """This rank's pipeline stage (or its virtual stage `vp_stage` under interleaving) as a GPTModel
    (parallel output: logits stay vocab-sharded)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron_flash.trainer.patches import moe_gemm, packed_rope
    from megatron_flash.trainer.patches.explicit_positions import positional_gpt_model

    packed_rope.install()  # packed rows' RoPE without a host sync per sample
    experts = spec.moe.num_experts if spec.moe is not None else None
    if experts:
        moe_gemm.apply()  # megatron-core 0.16 leaves moe_utils.te_general_gemm undefined without TE
    if transformer_engine:  # resolved by resolve_te
        layer_spec = get_gpt_layer_with_transformer_engine_spec(num_experts=experts, qk_layernorm=spec.qk_norm)
    else:
        from megatron_flash.trainer.packed_attention import packed_dot_product_attention

        from megatron_flash.trainer.norms import local_block_spec

        layer_spec = get_gpt_layer_local_spec(num_experts=experts, normalization="RMSNorm", qk_layernorm=spec.qk_norm)
        if attention == "flash":  # torch's flash kernels, packed or padded (flash_attention.py)
            from megatron_flash.trainer.flash_attention import flash_dot_product_attention

            core = flash_dot_product_attention()
        else:  # packed rows (THD): attention per sample, like TE's (packed_attention.py)
            core = packed_dot_product_attention()
        layer_spec.submodules.self_attention.submodules.core_attention = core
        layer_spec = local_block_spec(layer_spec, config, vp_stage=vp_stage)  # norms that allow sequence parallel
    model = positional_gpt_model()(  # GPTModel; packed rows' RoPE positions from position_ids
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(spec.vocab_size, divisible_by=make_vocab_size_divisible_by,
                                     tp_size=config.tensor_model_parallel_size),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta),
        vp_stage=vp_stage,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
