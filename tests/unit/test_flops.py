"""Model FLOPs and MFU (trainer/flops.py): the matmul weights per token against the nn.Linear weights of
the same model built by transformers, attention and MoE terms against sums written out by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_flash.hf.spec import MoESpec, read_hf_spec
from megatron_flash.trainer.flops import matmul_weights_per_token, peak_flops, step_speed, train_flops


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                                   num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                                   tie_word_embeddings=True)
    out = str(tmp_path_factory.mktemp("llama"))
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    torch.save(sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)), out + "/linear.pt")
    return out


def test_matmul_weights_equal_the_models_linear_layers(llama_dir: str) -> None:
    spec = read_hf_spec(llama_dir)
    assert matmul_weights_per_token(spec) == torch.load(llama_dir + "/linear.pt")  # lm_head counted once, tied


def test_attention_term_is_causal_over_each_sample(llama_dir: str) -> None:
    spec = read_hf_spec(llama_dir)
    n = matmul_weights_per_token(spec)
    # per layer and sample of L tokens: QKᵀ and PV each a·d multiply-adds per (query, key ≤ query) pair
    pairs = {1: 1, 3: 1 + 2 + 3, 5: 15}
    for L, p in pairs.items():
        expected = 3 * (2 * n * L + 2 * 2 * 6 * 8 * p * 3)
        assert train_flops(spec, [L]) == pytest.approx(expected)
    assert train_flops(spec, [3, 5]) == pytest.approx(train_flops(spec, [3]) + train_flops(spec, [5]))


def test_moe_counts_the_routed_experts_only(llama_dir: str) -> None:
    dense = read_hf_spec(llama_dir)
    moe = dataclasses.replace(dense, moe=MoESpec(num_experts=8, top_k=2, ffn_hidden_size=16, norm_topk_prob=True,
                                                 aux_loss_coef=0.0))
    per_layer_mlp_dense, per_layer_mlp_moe = 3 * 48 * 80, 2 * 3 * 48 * 16 + 48 * 8
    assert matmul_weights_per_token(dense) - matmul_weights_per_token(moe) == 3 * (per_layer_mlp_dense - per_layer_mlp_moe)


def test_peak_by_device_name_and_none_without_one(llama_dir: str) -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H200") == 989e12 and peak_flops("NVIDIA H20") == 148e12
    assert peak_flops(None) is None and peak_flops("Some Future GPU") is None
    out = step_speed(read_hf_spec(llama_dir), [4, 6], seconds=0.5, num_gpus=2, device=torch.device("cpu"))
    assert out["mfu"] is None
    assert out["tokens_per_s_per_gpu"] == pytest.approx(10 / 0.5 / 2)
    assert out["model_tflops_per_gpu"] == pytest.approx(train_flops(read_hf_spec(llama_dir), [4, 6]) / 0.5 / 2 / 1e12)
    assert out["peak_mem_gb"] > 0
