"""Read a HF `config.json` into the few numbers a Megatron GPT model needs (pure Python).

Supported architectures and what distinguishes them:

  architecture        family  q/k/v bias   q/k RMSNorm   head_dim
  ------------------  ------  -----------  ------------  ------------------------------
  LlamaForCausalLM    llama   attention_bias  no         hidden / heads (or head_dim)
  Qwen2ForCausalLM    qwen2   yes          no            hidden / heads
  Qwen3ForCausalLM    qwen3   attention_bias  yes        head_dim (explicit)
  Qwen3MoeForCausalLM qwen3_moe  as qwen3, every MLP a mixture of experts (top-k softmax router)

Mixture-of-experts fields (`moe` is None for dense models): experts, top-k, the expert FFN size,
whether the top-k probabilities are renormalised (`norm_topk_prob`) and the aux-loss coefficient.
A variant the trainer cannot represent (shared experts, dense layers between sparse ones) is refused
here, naming the config field, before any weight is read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


class CheckpointError(ValueError):
    """A HF checkpoint directory that cannot be used; the message names the file."""


@dataclasses.dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    ffn_hidden_size: int
    norm_topk_prob: bool
    aux_loss_coef: float


@dataclasses.dataclass(frozen=True)
class HFModelSpec:
    family: str
    architecture: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    moe: Optional[MoESpec] = None

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups


def _rope_theta(raw: dict[str, Any], path: str) -> float:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"{path}: rope type {rope_type!r} is not supported (only 'default')")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    return float(theta)


def read_hf_spec(model_dir: str) -> HFModelSpec:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"no config.json in HF checkpoint directory {model_dir!r}")
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{path}: architecture {arch!r} is not supported; supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // heads)
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"{path}: hidden_act {act!r} is not supported (only 'silu')")
        if raw.get("use_sliding_window"):  # Qwen2/Qwen3 configs carry a window they do not use unless this is set
            raise CheckpointError(f"{path}: use_sliding_window=true is not supported (the trainer's attention is "
                                  "full causal: it would train another model than the checkpoint's)")
        return HFModelSpec(
            family=family,
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            ffn_hidden_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_query_groups=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw, path),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else bool(raw.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            moe=_moe_spec(raw, path) if family == "qwen3_moe" else None,
        )
    except KeyError as e:
        raise CheckpointError(f"{path}: missing required field {e.args[0]!r}") from None


def _moe_spec(raw: dict[str, Any], path: str) -> MoESpec:
    layers = int(raw["num_hidden_layers"])
    step = int(raw.get("decoder_sparse_step", 1))
    dense = [int(i) for i in raw.get("mlp_only_layers") or []]
    if step != 1 or dense:  # Megatron could mix them (moe_layer_freq); no model we serve does
        field, value = ("decoder_sparse_step", step) if step != 1 else ("mlp_only_layers", dense)
        raise CheckpointError(f"{path}: {field}={value!r}: dense layers between MoE layers are not supported "
                              f"(every one of the {layers} layers must be sparse)")
    for field in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if raw.get(field):
            raise CheckpointError(f"{path}: {field}={raw[field]!r}: shared experts are not supported")
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    if experts is None:
        raise CheckpointError(f"{path}: missing required field 'num_experts'")
    top_k = int(raw["num_experts_per_tok"])
    if not 1 <= top_k <= int(experts):
        raise CheckpointError(f"{path}: num_experts_per_tok={top_k} must be in 1..num_experts={experts}")
    if top_k == 1 and raw.get("norm_topk_prob", False):
        # Every token's gate weight is then 1.0; Megatron-Core refuses top-1 without the softmax over
        # all experts first, which weights it by that expert's probability instead.
        raise CheckpointError(f"{path}: num_experts_per_tok=1 with norm_topk_prob=true is not representable "
                              "in Megatron-Core (top-1 routing needs the pre-top-k softmax)")
    return MoESpec(num_experts=int(experts), top_k=top_k, ffn_hidden_size=int(raw["moe_intermediate_size"]),
                   norm_topk_prob=bool(raw.get("norm_topk_prob", False)),  # transformers' default
                   aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)))
