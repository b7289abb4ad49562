"""LoRA's pure pieces: the config section and its refusals, the adapter layouts at every TP size, PEFT
names and config, the base fingerprint (no Megatron: hf/adapters.py and the schema only)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from megatron_flash.config import ConfigError, load_config
from megatron_flash.config.schema import LORA_TARGETS
from megatron_flash.hf import adapters
from megatron_flash.hf.layouts import DictReader
from megatron_flash.hf.name_maps import NAME_MAPS
from megatron_flash.hf.spec import CheckpointError, HFModelSpec, MoESpec

SPEC = HFModelSpec(family="llama", architecture="LlamaForCausalLM", vocab_size=100, hidden_size=16,
                   ffn_hidden_size=24, num_layers=2, num_attention_heads=4, num_query_groups=2, head_dim=4,
                   norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=False,
                   qkv_bias=False, qk_norm=False)
BASE = ["model.hf_path=/unused"]


def test_targets_are_defined_once() -> None:
    """The config names the targets; the trainer takes that tuple, the HF maps are keyed by it."""
    from megatron_flash.trainer.lora import TARGETS

    assert TARGETS is LORA_TARGETS == ("qkv", "proj", "fc1", "fc2")
    assert tuple(adapters.TARGET_MODULES) == tuple(adapters.HF_TARGET_MODULES) == LORA_TARGETS
    assert adapters.TARGET_MODULES["fc1"] == "mlp.linear_fc1" and adapters.HF_TARGET_MODULES["proj"] == ("o_proj",)


@pytest.mark.parametrize("overrides,message", [
    (["model.lora.alpha=16"], "model.lora.alpha=16.0 is only used with LoRA on"),
    (["model.lora.targets=[qkv]"], "model.lora.targets=['qkv'] is only used with LoRA on"),
    (["model.lora.rank=4", "model.lora.targets=[qkv,mlp]"], "model.lora.targets must be a list of distinct names"),
    (["model.lora.rank=4", "model.lora.targets=[]"], "model.lora.targets must be a list"),
    (["model.lora.rank=4", "model.lora.dropout=1.0"], "model.lora.dropout must be in [0, 1)"),
    (["model.lora.rank=4", "model.lora.alpha=0"], "model.lora.alpha must be > 0"),
    (["model.lora.rank=-1"], "model.lora.rank must be >= 0"),
    (["model.lora.rank=4", "model.use_transformer_engine=true"], "needs the local layer spec"),
    (["weight_sync.lora=merged"], "weight_sync.lora=merged is only used with LoRA on"),
    (["model.lora.rank=4", "weight_sync.lora=adapter", "weight_sync.transport=broadcast"],
     "use weight_sync.transport=ipc or disk"),
    (["model.lora.rnak=4"], "did you mean 'model.lora.rank'"),
    (["model.lora.rank=4", "weight_sync.lora=adapter", "engines.colocate=true", "async_rl.alpha=0"],
     "use weight_sync.lora=merged"),
])
def test_bad_lora_settings_are_refused_by_name(overrides: list[str], message: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=None) as info:
        load_config(None, BASE + overrides)
    assert message in str(info.value)


def test_all_targets_and_the_sync_mode() -> None:
    cfg = load_config(None, BASE + ["model.lora.rank=8", "model.lora.targets=[all]"])
    assert cfg.model.lora.targets == list(LORA_TARGETS)
    assert cfg.lora_sync_mode() == "adapter"  # local engines take adapters
    assert load_config(None, BASE + ["model.lora.rank=8", "engines.backend=sglang"]).lora_sync_mode() == "merged"
    assert load_config(None, BASE + ["model.lora.rank=8", "weight_sync.transport=broadcast"]).lora_sync_mode() == "merged"
    assert load_config(None, BASE + ["model.lora.rank=8", "engines.colocate=true",
                                     "async_rl.alpha=0"]).lora_sync_mode() == "merged"
    assert load_config(None, BASE).lora_sync_mode() == ""


def test_check_lora_refuses_experts_and_te() -> None:
    from megatron_flash.trainer.lora import LoraOptions, check_lora

    moe = dataclasses.replace(SPEC, family="qwen3_moe", moe=MoESpec(num_experts=4, top_k=2, ffn_hidden_size=8,
                                                                     norm_topk_prob=True, aux_loss_coef=0.0))
    check_lora(moe, LoraOptions(rank=2, targets=("qkv", "proj")), uses_te=False)
    with pytest.raises(ValueError, match=r"fc1, fc2 would adapt the experts"):
        check_lora(moe, LoraOptions(rank=2), uses_te=False)
    with pytest.raises(ValueError, match="Transformer Engine"):
        check_lora(SPEC, LoraOptions(rank=2), uses_te=True)


def _full_adapter(rule, hf, rank: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random HF-named adapter tensors of one Megatron site (one shared A for fused modules)."""
    shapes = {"model.layers.0.self_attn.q_proj.weight": (16, 16), "model.layers.0.self_attn.k_proj.weight": (8, 16),
              "model.layers.0.self_attn.v_proj.weight": (8, 16), "model.layers.0.self_attn.o_proj.weight": (16, 16),
              "model.layers.0.mlp.gate_proj.weight": (24, 16), "model.layers.0.mlp.up_proj.weight": (24, 16),
              "model.layers.0.mlp.down_proj.weight": (16, 24)}
    a = torch.randn(rank, shapes[hf[0]][1], generator=gen)
    out = {n: a for n in adapters.adapter_names(hf, "lora_a")}
    for name, weight in zip(adapters.adapter_names(hf, "lora_b"), hf):
        out[name] = torch.randn(shapes[weight][0], rank, generator=gen)
    return out


@pytest.mark.parametrize("target", list(adapters.TARGET_MODULES))
@pytest.mark.parametrize("tp", [1, 2])
def test_shards_reassemble_to_the_adapter_and_match_the_full_delta(target: str, tp: int) -> None:
    """Each rank's (A, B) shard gives exactly its shard of the full s·B·A laid out like the base weight,
    and gathering the shards gives the PEFT tensors back."""
    rule, hf = NAME_MAPS["llama"].resolve(f"decoder.layers.0.{adapters.TARGET_MODULES[target]}.weight",
                                          layer_offset=0, tied=False)
    full = _full_adapter(rule, hf, 3, torch.Generator().manual_seed(0))
    reader = DictReader(full)
    # The full delta in HF layout, per HF module, then as the base weight's Megatron shard on each rank.
    deltas = {w: full[b] @ full[a] for w, a, b in zip(hf, adapters.adapter_names(hf, "lora_a"),
                                                    adapters.adapter_names(hf, "lora_b"))}
    from megatron_flash.hf.layouts import hf_to_shard

    shards = {which: [] for which in adapters.ADAPTER_PARAMS}
    for r in range(tp):
        a, b = (adapters.adapter_to_shard(w, rule, hf, reader, spec=SPEC, tp_rank=r, tp_size=tp)
                for w in adapters.ADAPTER_PARAMS)
        want = hf_to_shard(rule, hf, DictReader(deltas), spec=SPEC, tp_rank=r, tp_size=tp, padded_vocab_size=0)
        assert torch.allclose(b @ a, want, atol=1e-6), (target, r)
        shards["lora_a"].append(a)
        shards["lora_b"].append(b)
    for which in adapters.ADAPTER_PARAMS:
        whole = (which == "lora_a") == adapters.is_column(rule)
        back = adapters.shards_to_adapter(which, rule, hf, shards[which][:1] if whole else shards[which], spec=SPEC)
        assert back.keys() == set(adapters.adapter_names(hf, which))
        assert all(torch.equal(back[k], full[k]) for k in back)


def test_unfusable_adapter_is_refused() -> None:
    rule, hf = NAME_MAPS["llama"].resolve("decoder.layers.0.self_attention.linear_qkv.weight", layer_offset=0, tied=False)
    full = _full_adapter(rule, hf, 2, torch.Generator().manual_seed(0))
    full["model.layers.0.self_attn.k_proj.lora_A.weight"] = full["model.layers.0.self_attn.k_proj.lora_A.weight"] + 1
    with pytest.raises(CheckpointError, match="q_proj.lora_A.weight and .*k_proj.lora_A.weight differ"):
        adapters.adapter_to_shard("lora_a", rule, hf, DictReader(full), spec=SPEC, tp_rank=0, tp_size=1)


def test_peft_config_round_trip_and_partial_targets(tmp_path) -> None:
    config = adapters.peft_config(rank=8, alpha=16, dropout=0.0, targets=("qkv", "fc2"), base_model="/b")
    assert config["target_modules"] == ["down_proj", "k_proj", "q_proj", "v_proj"]
    assert adapters.targets_of(config) == ("qkv", "fc2")
    with pytest.raises(CheckpointError, match="must cover all of them or none"):
        adapters.targets_of({"target_modules": ["q_proj", "v_proj"]})
    with pytest.raises(CheckpointError, match=r"\['lm_head'\] have no megatron-flash LoRA target"):
        adapters.targets_of({"target_modules": ["lm_head"]})
    adapters.write_peft_adapter(str(tmp_path / "a"), {"model.layers.0.self_attn.o_proj.lora_A.weight": torch.ones(2, 3)},
                                config)
    got_config, tensors = adapters.read_peft_adapter(str(tmp_path / "a"))
    assert got_config == config and list(tensors) == ["model.layers.0.self_attn.o_proj.lora_A.weight"]
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(CheckpointError, match=r"use_dora=True \(DoRA's magnitude vectors\) is not honoured here"):
        adapters.read_peft_adapter(str(tmp_path / "a"))
    with pytest.raises(CheckpointError, match="adapter_config.json is missing"):
        adapters.read_peft_adapter(str(tmp_path))


@pytest.mark.parametrize("key, value, why", [
    ("alpha_pattern", {"q_proj": 64}, "a per-module lora_alpha"),
    ("rank_pattern", {"down_proj": 2}, "a per-module rank"),
    ("bias", "lora_only", "trained biases"),
    ("modules_to_save", ["lm_head"], "whole modules trained"),
    ("use_rslora", True, "rsLoRA"),
    ("layers_to_transform", [0], "adapters on some layers only"),
    ("some_future_option", {"x": 1}, "a PEFT option this loader does not implement"),
])
def test_peft_fields_that_change_the_function_are_refused_by_name(key: str, value, why: str) -> None:
    from peft import LoraConfig

    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj"]).to_dict()
    config = {k: (v.value if hasattr(v, "value") else v) for k, v in config.items()}  # PeftType → its string
    adapters.check_peft_fields(config, where="adapter_config.json")  # PEFT's own defaults: nothing refused
    with pytest.raises(CheckpointError, match=rf"^adapter_config.json: {key}=.*\({why}.*is not honoured here"):
        adapters.check_peft_fields({**config, key: value}, where="adapter_config.json")


def test_canonical_adapter_is_layout_free_and_starts_at_zero() -> None:
    rule, hf = NAME_MAPS["llama"].resolve("decoder.layers.1.mlp.linear_fc1.weight", layer_offset=0, tied=False)
    shapes = DictReader({hf[0]: torch.empty(24, 16), hf[1]: torch.empty(24, 16)})
    a1 = adapters.canonical_adapter("lora_a", rule, hf, shapes, rank=4, seed=7)
    a2 = adapters.canonical_adapter("lora_a", rule, hf, shapes, rank=4, seed=7)
    b = adapters.canonical_adapter("lora_b", rule, hf, shapes, rank=4, seed=7)
    assert all(torch.equal(a1[k], a2[k]) for k in a1) and len({id(v) for v in a1.values()}) == 1
    assert next(iter(a1.values())).abs().max() <= 1 / 4  # U(±1/sqrt(16))
    assert all(v.shape == (24, 4) and not v.any() for v in b.values())
    other = adapters.canonical_adapter("lora_a", rule, hf, shapes, rank=4, seed=8)
    assert not torch.equal(next(iter(other.values())), next(iter(a1.values())))


def test_base_fingerprint_follows_the_checkpoint(tmp_path) -> None:
    from safetensors.torch import save_file

    os.makedirs(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text('{"a": 1}')
    save_file({"w": torch.zeros(2, 2)}, str(tmp_path / "m" / "model.safetensors"))
    first = adapters.base_fingerprint(str(tmp_path / "m"))
    assert adapters.base_fingerprint(str(tmp_path / "m")) == first
    save_file({"w": torch.ones(2, 2)}, str(tmp_path / "m" / "model.safetensors"))  # same shapes, other values
    second = adapters.base_fingerprint(str(tmp_path / "m"))
    assert second != first
    save_file({"w": torch.ones(2, 3)}, str(tmp_path / "m" / "model.safetensors"))
    assert adapters.base_fingerprint(str(tmp_path / "m")) not in (first, second)
    with pytest.raises(CheckpointError, match="another base model"):
        adapters.check_same_base(first, str(tmp_path / "m"), what="adapter X")
