"""Name maps and TP shard layouts (pure torch): shard → unshard round trips, hand-built QKV layout."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_flash.hf.spec import HFModelSpec
from megatron_flash.hf.layouts import DictReader, hf_to_shard, shards_to_hf
from megatron_flash.hf.name_maps import NAME_MAPS, Rule

SPEC = HFModelSpec(
    family="llama", architecture="LlamaForCausalLM", vocab_size=10, hidden_size=8, ffn_hidden_size=12,
    num_layers=4, num_attention_heads=4, num_query_groups=2, head_dim=2, norm_eps=1e-6, rope_theta=1e4,
    max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=True, qk_norm=False,
)


def hf_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    d, h = SPEC.head_dim, SPEC.hidden_size
    return {
        "q": r(SPEC.num_attention_heads * d, h), "k": r(SPEC.num_query_groups * d, h),
        "v": r(SPEC.num_query_groups * d, h), "qb": r(SPEC.num_attention_heads * d),
        "kb": r(SPEC.num_query_groups * d), "vb": r(SPEC.num_query_groups * d),
        "gate": r(12, h), "up": r(12, h), "down": r(h, 12), "embed": r(10, h), "norm": r(h),
    }


CASES = [
    (Rule("w", ("q", "k", "v"), "qkv"), ("q", "k", "v")),
    (Rule("b", ("qb", "kb", "vb"), "qkv"), ("qb", "kb", "vb")),
    (Rule("w", ("gate", "up"), "gate_up"), ("gate", "up")),
    (Rule("w", ("down",), "row"), ("down",)),
    (Rule("w", ("gate",), "column"), ("gate",)),
    (Rule("w", ("embed",), "vocab"), ("embed",)),
    (Rule("w", ("norm",), "replicated"), ("norm",)),
]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("rule,names", CASES, ids=[c[0].layout + str(len(c[1])) for c in CASES])
def test_shard_then_unshard_is_identity(rule: Rule, names: tuple[str, ...], tp: int) -> None:
    tensors = hf_tensors()
    reader = DictReader(tensors)
    padded = 16
    shards = [hf_to_shard(rule, names, reader, spec=SPEC, tp_rank=r, tp_size=tp, padded_vocab_size=padded)
              for r in range(tp)]
    back = shards_to_hf(rule, names, shards, spec=SPEC)
    assert set(back) == set(names)
    for n in names:
        assert torch.equal(back[n], tensors[n]), n


def test_qkv_shard_follows_megatron_group_order() -> None:
    """Rank 1 of TP2 owns query group 1: q heads 2-3, then k_1, then v_1 (rows written out by hand)."""
    d = SPEC.head_dim
    q = torch.arange(8 * 1.0).repeat_interleave(1).reshape(8, 1)  # q rows 0..7 = 4 heads × d=2
    k = 100 + torch.arange(4 * 1.0).reshape(4, 1)
    v = 200 + torch.arange(4 * 1.0).reshape(4, 1)
    spec = dataclasses.replace(SPEC, hidden_size=1)
    shard = hf_to_shard(Rule("w", ("q", "k", "v"), "qkv"), ("q", "k", "v"), DictReader({"q": q, "k": k, "v": v}),
                        spec=spec, tp_rank=1, tp_size=2, padded_vocab_size=16)
    assert d == 2
    assert shard.flatten().tolist() == [4, 5, 6, 7, 102, 103, 202, 203]


def test_gate_up_shard_is_gate_then_up_per_rank() -> None:
    gate = torch.arange(4.0).reshape(4, 1)
    up = 10 + torch.arange(4.0).reshape(4, 1)
    shard = hf_to_shard(Rule("w", ("g", "u"), "gate_up"), ("g", "u"), DictReader({"g": gate, "u": up}),
                        spec=SPEC, tp_rank=0, tp_size=2, padded_vocab_size=16)
    assert shard.flatten().tolist() == [0, 1, 10, 11]


def test_vocab_shard_pads_with_zeros_and_unshard_strips() -> None:
    embed = torch.ones(10, 3)
    rule = Rule("w", ("e",), "vocab")
    shards = [hf_to_shard(rule, ("e",), DictReader({"e": embed}), spec=SPEC, tp_rank=r, tp_size=2,
                          padded_vocab_size=16) for r in range(2)]
    assert shards[0].shape == (8, 3) and shards[1].shape == (8, 3)
    assert shards[1][:2].eq(1).all() and shards[1][2:].eq(0).all()
    assert shards_to_hf(rule, ("e",), shards, spec=SPEC)["e"].shape == (10, 3)


def test_name_map_resolves_global_layer_and_tied_output() -> None:
    m = NAME_MAPS["qwen3"]
    rule, names = m.resolve("decoder.layers.1.self_attention.linear_qkv.weight", layer_offset=2, tied=True)
    assert rule.layout == "qkv"
    assert names == tuple(f"model.layers.3.self_attn.{p}_proj.weight" for p in "qkv")
    _, names = m.resolve("output_layer.weight", layer_offset=0, tied=True)
    assert names == ("model.embed_tokens.weight",)
    _, names = NAME_MAPS["llama"].resolve("output_layer.weight", layer_offset=0, tied=False)
    assert names == ("lm_head.weight",)
    _, names = m.resolve("decoder.layers.0.self_attention.k_layernorm.weight", layer_offset=5, tied=True)
    assert names == ("model.layers.5.self_attn.k_norm.weight",)
    with pytest.raises(KeyError, match="no llama name-map rule"):
        NAME_MAPS["llama"].resolve("decoder.layers.0.self_attention.q_layernorm.weight", layer_offset=0, tied=False)


def test_transformer_engine_fused_norm_names_map_to_hf_norms() -> None:
    m = NAME_MAPS["llama"]
    _, names = m.resolve("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", layer_offset=1, tied=False)
    assert names == ("model.layers.1.input_layernorm.weight",)
    _, names = m.resolve("decoder.layers.2.mlp.linear_fc1.layer_norm_weight", layer_offset=0, tied=False)
    assert names == ("model.layers.2.post_attention_layernorm.weight",)
