"""model.attention_backend (trainer/flash_attention.py) on a CPU: what each setting resolves to or why it
is refused, and the padded (SDPA) path against causal attention written out by hand. The packed
varlen path needs CUDA: tests/gpu/test_gpu_attention.py."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_flash.config import load_config
from megatron_flash.trainer.flash_attention import attention_backend, flash_dot_product_attention

BASE = ["model.hf_path=/unused", "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=16"]


def test_config_refuses_flash_in_float32_and_unknown_backends() -> None:
    with pytest.raises(ValueError, match="model.attention_backend=flash needs model.dtype=bfloat16"):
        load_config(None, BASE + ["model.attention_backend=flash"])
    with pytest.raises(ValueError, match="model.attention_backend"):
        load_config(None, BASE + ["model.attention_backend=xformers"])
    assert load_config(None, BASE + ["model.attention_backend=flash", "model.dtype=bfloat16"]).model.attention_backend == "flash"


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA resolves")
def test_resolution_without_cuda() -> None:
    assert attention_backend("auto", uses_te=False, dtype="bfloat16") == "local"
    assert attention_backend("local", uses_te=False, dtype="bfloat16") == "local"
    with pytest.raises(ValueError, match="model.attention_backend=flash needs CUDA"):
        attention_backend("flash", uses_te=False, dtype="bfloat16")
    assert attention_backend("auto", uses_te=True, dtype="bfloat16") == "te"
    with pytest.raises(ValueError, match="Transformer Engine's attention is in use"):
        attention_backend("local", uses_te=True, dtype="bfloat16")


def test_padded_path_is_causal_gqa_attention_with_megatrons_scale() -> None:
    cls = flash_dot_product_attention()
    attn = object.__new__(cls)  # the forward reads only flash_scale (no parallel state needed)
    torch.nn.Module.__init__(attn)
    attn.flash_scale = 0.3
    g = torch.Generator().manual_seed(0)
    s, b, heads, groups, d = 5, 2, 4, 2, 3
    q, k, v = (torch.randn(s, b, h, d, generator=g) for h in (heads, groups, groups))
    out = attn.forward(q, k, v, None)
    assert out.shape == (s, b, heads * d)
    for bi in range(b):
        for h in range(heads):
            kv = h // (heads // groups)
            for i in range(s):
                scores = [0.3 * float(q[i, bi, h] @ k[j, bi, kv]) for j in range(i + 1)]
                top = max(scores)
                w = [math.exp(x - top) for x in scores]
                expected = sum(wj * v[j, bi, kv] for j, wj in enumerate(w)) / sum(w)
                assert torch.allclose(out[i, bi, h * d:(h + 1) * d], expected, atol=1e-5)
