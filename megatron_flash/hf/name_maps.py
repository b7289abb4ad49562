"""Megatron ⇄ HF parameter names per model family, as data.

A rule says which HF tensor(s) one Megatron parameter is made of and how its tensor-parallel shard
is laid out (the layouts are implemented in `layouts.py`). `{layer}` is the *global* layer index;
PP stages number their layers locally and the bridge adds the stage's layer offset. `{expert}` is the
*global* expert index: an expert-parallel rank numbers its experts locally and the caller adds the
rank's first expert. An expert's shard is split over the expert-tensor-parallel group, every other
parameter's over the tensor-parallel group.

  layout       Megatron shard on TP rank r (of t)                       HF tensors
  -----------  -------------------------------------------------------  --------------------------
  replicated   full tensor (norms)                                      one
  column       rows r·n/t … (r+1)·n/t                                   one
  row          columns r·n/t … (r+1)·n/t                                one
  vocab        rows of the vocabulary padded to t·k, zeros past V       one
  qkv          for each query group g of rank r: [q heads of g; k_g; v_g] q, k, v
  gate_up      [gate rows of r; up rows of r]  (SwiGLU fc1)             gate, up

Adding a family = adding a `NameMap` below and a parity test; nothing else branches on families.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from megatron_flash.hf.spec import HFModelSpec

LAYOUTS = ("replicated", "column", "row", "vocab", "qkv", "gate_up")


@dataclasses.dataclass(frozen=True)
class Rule:
    megatron: str
    hf: tuple[str, ...]
    layout: str

    def __post_init__(self) -> None:
        assert self.layout in LAYOUTS, self.layout
        self._regex()  # compile early so a bad pattern fails at import

    @property
    def is_expert(self) -> bool:
        return "{expert}" in self.megatron

    def _regex(self) -> "re.Pattern[str]":
        pattern = re.escape(self.megatron).replace(r"\{layer\}", r"(?P<layer>\d+)")
        return re.compile("^" + pattern.replace(r"\{expert\}", r"(?P<expert>\d+)") + "$")

    def match(self, megatron_name: str) -> Optional[dict[str, int]]:
        """The name's local `layer` / `expert` indices (an empty dict for a non-layer parameter) if
        it matches, else None."""
        m = self._regex().match(megatron_name)
        if m is None:
            return None
        return {k: int(v) for k, v in m.groupdict().items()}


@dataclasses.dataclass(frozen=True)
class NameMap:
    family: str
    rules: tuple[Rule, ...]
    # HF name used for the output layer when input and output embeddings are tied.
    tied_output_hf: str = "model.embed_tokens.weight"

    def resolve(self, megatron_name: str, *, layer_offset: int, tied: bool,
                expert_offset: int = 0) -> tuple[Rule, tuple[str, ...]]:
        """HF names for a Megatron parameter named with *local* layer numbering on this PP stage
        (and local expert numbering on this expert-parallel rank)."""
        for rule in self.rules:
            index = rule.match(megatron_name)
            if index is None:
                continue
            if rule.megatron == "output_layer.weight" and tied:
                return rule, (self.tied_output_hf,)
            fields = {"layer": index.get("layer", -1) + layer_offset, "expert": index.get("expert", -1) + expert_offset}
            names = tuple(n.format(**fields) for n in rule.hf)
            return rule, names
        raise KeyError(f"no {self.family} name-map rule for Megatron parameter {megatron_name!r}")


_ATTN = "model.layers.{layer}.self_attn."
_MLP = "model.layers.{layer}.mlp."
_LAYER = "decoder.layers.{layer}."

_LLAMA_RULES = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    Rule(_LAYER + "input_layernorm.weight", ("model.layers.{layer}.input_layernorm.weight",), "replicated"),
    Rule(_LAYER + "self_attention.linear_qkv.weight",
         (_ATTN + "q_proj.weight", _ATTN + "k_proj.weight", _ATTN + "v_proj.weight"), "qkv"),
    Rule(_LAYER + "self_attention.linear_qkv.bias",
         (_ATTN + "q_proj.bias", _ATTN + "k_proj.bias", _ATTN + "v_proj.bias"), "qkv"),
    Rule(_LAYER + "self_attention.linear_proj.weight", (_ATTN + "o_proj.weight",), "row"),
    Rule(_LAYER + "pre_mlp_layernorm.weight",
         ("model.layers.{layer}.post_attention_layernorm.weight",), "replicated"),
    Rule(_LAYER + "mlp.linear_fc1.weight", (_MLP + "gate_proj.weight", _MLP + "up_proj.weight"), "gate_up"),
    Rule(_LAYER + "mlp.linear_fc2.weight", (_MLP + "down_proj.weight",), "row"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"),
    Rule("output_layer.weight", ("lm_head.weight",), "vocab"),
)

# Transformer-Engine layer spec fuses the pre-attention / pre-MLP norms into the next linear layer.
_TE_FUSED_NORM_RULES = (
    Rule(_LAYER + "self_attention.linear_qkv.layer_norm_weight",
         ("model.layers.{layer}.input_layernorm.weight",), "replicated"),
    Rule(_LAYER + "mlp.linear_fc1.layer_norm_weight",
         ("model.layers.{layer}.post_attention_layernorm.weight",), "replicated"),
)

_QK_NORM_RULES = (
    Rule(_LAYER + "self_attention.q_layernorm.weight", (_ATTN + "q_norm.weight",), "replicated"),
    Rule(_LAYER + "self_attention.k_layernorm.weight", (_ATTN + "k_norm.weight",), "replicated"),
)

# Qwen3-MoE: every MLP is a router + experts (Megatron's SequentialMLP: one fc1/fc2 per expert).
_EXPERT = _LAYER + "mlp.experts.local_experts.{expert}."
_HF_EXPERT = _MLP + "experts.{expert}."
_MOE_RULES = (
    Rule(_LAYER + "mlp.router.weight", (_MLP + "gate.weight",), "replicated"),
    Rule(_EXPERT + "linear_fc1.weight", (_HF_EXPERT + "gate_proj.weight", _HF_EXPERT + "up_proj.weight"), "gate_up"),
    Rule(_EXPERT + "linear_fc2.weight", (_HF_EXPERT + "down_proj.weight",), "row"),
)
_DENSE_MLP = (_LAYER + "mlp.linear_fc1.weight", _LAYER + "mlp.linear_fc2.weight", _LAYER + "mlp.linear_fc1.layer_norm_weight")

NAME_MAPS: dict[str, NameMap] = {
    "llama": NameMap("llama", _LLAMA_RULES + _TE_FUSED_NORM_RULES),
    "qwen2": NameMap("qwen2", _LLAMA_RULES + _TE_FUSED_NORM_RULES),
    "qwen3": NameMap("qwen3", _LLAMA_RULES + _TE_FUSED_NORM_RULES + _QK_NORM_RULES),
    "qwen3_moe": NameMap("qwen3_moe", tuple(r for r in _LLAMA_RULES + _TE_FUSED_NORM_RULES if r.megatron not in _DENSE_MLP)
                         + _QK_NORM_RULES + _MOE_RULES),
}


def name_map_for(spec: HFModelSpec) -> NameMap:
    return NAME_MAPS[spec.family]
