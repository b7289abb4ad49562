"""Read a HF `config.json` into the few numbers a Megatron GPT model needs (pure Python).

Supported architectures and what distinguishes them:

  architecture        family  q/k/v bias   q/k RMSNorm   head_dim
  ------------------  ------  -----------  ------------  ------------------------------
  LlamaForCausalLM    llama   attention_bias  no         hidden / heads (or head_dim)
  Qwen2ForCausalLM    qwen2   yes          no            hidden / heads
  Qwen3ForCausalLM    qwen3   attention_bias  yes        head_dim (explicit)
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class CheckpointError(ValueError):
    """A HF checkpoint directory that cannot be used; the message names the file."""


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
            qk_norm=family == "qwen3",
        )
    except KeyError as e:
        raise CheckpointError(f"{path}: missing required field {e.args[0]!r}") from None
