"""Bad checkpoints and layouts give clear errors naming the file, tensor or quantity (no Megatron)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from megatron_flash.hf.io import SafetensorsReader
from megatron_flash.trainer.model_builder import padded_vocab_size, validate_layout
from megatron_flash.hf.spec import CheckpointError, read_hf_spec
from tests.conftest import run_tool

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 48, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
}


def write_dir(path, config=CONFIG, tensors=None) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if tensors is not None:
        save_file(tensors, os.path.join(path, "model.safetensors"))
    return str(path)


def test_reads_supported_config(tmp_path) -> None:
    spec = read_hf_spec(write_dir(tmp_path))
    assert (spec.family, spec.head_dim, spec.heads_per_group, spec.qkv_bias) == ("llama", 16, 2, False)


def test_unsupported_architecture_lists_supported(tmp_path) -> None:
    d = write_dir(tmp_path, {**CONFIG, "architectures": ["MistralForCausalLM"]})
    with pytest.raises(CheckpointError, match=r"'MistralForCausalLM' is not supported; supported: "
                                              r"LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM"):
        read_hf_spec(d)


def test_sliding_window_attention_is_refused(tmp_path) -> None:
    """A window the checkpoint does not use (Qwen2's sliding_window with use_sliding_window=false) is fine."""
    qwen2 = {**CONFIG, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096, "use_sliding_window": False}
    assert read_hf_spec(write_dir(tmp_path / "a", qwen2)).family == "qwen2"
    with pytest.raises(CheckpointError, match="use_sliding_window=true is not supported"):
        read_hf_spec(write_dir(tmp_path / "b", {**qwen2, "use_sliding_window": True}))


MOE_CONFIG = {**CONFIG, "architectures": ["Qwen3MoeForCausalLM"], "head_dim": 16, "num_experts": 8,
              "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001}


def test_reads_moe_config(tmp_path) -> None:
    spec = read_hf_spec(write_dir(tmp_path / "a", MOE_CONFIG))
    assert spec.family == "qwen3_moe" and spec.qk_norm
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.ffn_hidden_size, spec.moe.norm_topk_prob) == (8, 2, 32, True)
    # transformers 5 writes num_local_experts instead of num_experts
    renamed = {k: v for k, v in MOE_CONFIG.items() if k != "num_experts"} | {"num_local_experts": 4}
    assert read_hf_spec(write_dir(tmp_path / "b", renamed)).moe.num_experts == 4


@pytest.mark.parametrize("field,value,message", [
    ("shared_expert_intermediate_size", 64, "shared_expert_intermediate_size=64: shared experts are not supported"),
    ("mlp_only_layers", [1], r"mlp_only_layers=\[1\]: dense layers between MoE layers are not supported"),
    ("decoder_sparse_step", 2, "decoder_sparse_step=2: dense layers between MoE layers"),
    ("num_experts_per_tok", 9, "num_experts_per_tok=9 must be in 1..num_experts=8"),
    ("num_experts_per_tok", 1, "num_experts_per_tok=1 with norm_topk_prob=true is not representable"),
])
def test_moe_variants_the_trainer_cannot_represent_are_named(tmp_path, field, value, message) -> None:
    with pytest.raises(CheckpointError, match=message):
        read_hf_spec(write_dir(tmp_path, {**MOE_CONFIG, field: value}))


def test_missing_config_and_bad_json_name_the_file(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="no config.json"):
        read_hf_spec(str(tmp_path))
    (tmp_path / "config.json").write_text("{\n  \"vocab_size\": 4,\n  oops\n}")
    with pytest.raises(CheckpointError, match=r"config.json: not valid JSON \(line 3"):
        read_hf_spec(str(tmp_path))


def test_missing_field_and_rope_scaling(tmp_path) -> None:
    cfg = dict(CONFIG)
    del cfg["intermediate_size"]
    with pytest.raises(CheckpointError, match="missing required field 'intermediate_size'"):
        read_hf_spec(write_dir(tmp_path / "a", cfg))
    with pytest.raises(CheckpointError, match="rope type 'yarn' is not supported"):
        read_hf_spec(write_dir(tmp_path / "b", {**CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))


def test_missing_and_corrupt_safetensors(tmp_path) -> None:
    d = write_dir(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        SafetensorsReader(d)
    d = write_dir(tmp_path / "corrupt")
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    with pytest.raises(CheckpointError, match="cannot read safetensors file .*model.safetensors"):
        SafetensorsReader(d)


def test_missing_tensor_is_named(tmp_path) -> None:
    d = write_dir(tmp_path, tensors={"model.norm.weight": torch.ones(64)})
    reader = SafetensorsReader(d)
    with pytest.raises(CheckpointError, match="'model.embed_tokens.weight' is missing"):
        reader.read("model.embed_tokens.weight")
    assert reader.read("model.norm.weight", rows=slice(0, 3)).tolist() == [1.0, 1.0, 1.0]


def test_layout_validation_names_the_quantity(tmp_path) -> None:
    spec = read_hf_spec(write_dir(tmp_path))
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by parallel.tensor_model_parallel_size=3"):
        validate_layout(spec, tp_size=3, pp_size=1)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=4 is larger than the model's num_hidden_layers=2"):
        validate_layout(spec, tp_size=1, pp_size=4)
    odd = dataclasses.replace(spec, num_layers=3)
    with pytest.raises(ValueError, match="num_hidden_layers=3 is not divisible by parallel.pipeline_model_parallel_size=2"):
        validate_layout(odd, tp_size=1, pp_size=2)
    validate_layout(spec, tp_size=2, pp_size=2)


def test_vocab_is_padded_for_tp_instead_of_rejected() -> None:
    assert padded_vocab_size(48, divisible_by=128, tp_size=1) == 128
    assert padded_vocab_size(48, divisible_by=128, tp_size=2) == 256
    assert padded_vocab_size(151936, divisible_by=128, tp_size=8) == 152576


def test_check_parity_exits_nonzero_with_message(tmp_path, tiny_models) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(tiny_models["llama"], bad)
    os.remove(bad / "model.safetensors")
    proc = run_tool(["tools/check_parity.py", "--hf-dir", str(bad)], check=False)
    assert proc.returncode == 2
    assert "no *.safetensors files" in proc.stderr
    proc = run_tool(["tools/check_parity.py", "--hf-dir", tiny_models["llama"], "--tp", "3"], check=False)
    assert proc.returncode == 2 and "not divisible by parallel.tensor_model_parallel_size=3" in proc.stderr


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_make_tiny_model_is_deterministic(tmp_path, tiny_models, arch) -> None:
    again = tmp_path / "again"
    run_tool(["tools/make_tiny_model.py", "--out", str(again), "--arch", arch, "--seed", "0"])
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == open(os.path.join(tiny_models[arch], name), "rb").read(), name
    other = tmp_path / "other"
    run_tool(["tools/make_tiny_model.py", "--out", str(other), "--arch", "llama", "--seed", "1"])
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


def test_tiny_tokenizer_is_per_character(tiny_models) -> None:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    ids = tok("3142:1234", add_special_tokens=False)["input_ids"]
    assert len(ids) == 9 and tok.decode(ids) == "3142:1234"
    assert tok.eos_token == "</s>" and tok.pad_token == "<pad>"
