"""Core attention on CUDA without Transformer Engine: torch's own flash kernels behind Megatron's
DotProductAttention interface (config `model.attention_backend`, resolved by `attention_backend()`).

  packed rows (THD, PackedSeqParams)   torch.nn.attention.varlen.varlen_attn: FlashAttention-2 over
                                       the row with its cu_seqlens, causal within each sample, GQA
                                       key/value heads as they are; cost Σ l², one kernel per layer
  padded rows (SBHD)                   torch.nn.functional.scaled_dot_product_attention, causal, GQA
  shared prefixes                      varlen_attn with the responses' keys gathered as [prompt; own]
                                       and their own cu_seqlens (trainer/shared_prefix.py)

The scale is Megatron's (1/√d or config.softmax_scale; query-key layer scaling cancels out in exact
arithmetic, so the product of the two factors is what the kernel gets). Dropout is refused (RL
training runs without it). The per-sample local path (packed_attention.py) stays the reference and the
path for CPU and float32; tests/gpu compares the two on CUDA.

varlen_attn's causal argument changed between torch releases (`is_causal=True` in 2.10, a
`window_size=(-1, 0)` from 2.11) and `enable_gqa` arrived later still: both are read from its
signature once.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

from megatron_flash.trainer import attention_plan
from megatron_flash.trainer.patches import cp_attention

_CLASS: Optional[type] = None


def attention_backend(setting: str, *, uses_te: bool, dtype: str) -> str:
    """'flash' or 'local' for model.attention_backend=`setting` on this machine (ValueError when the
    setting cannot run here)."""
    if uses_te:
        if setting != "auto":
            raise ValueError(f"model.attention_backend={setting} applies to the local layer spec, but Transformer "
                             "Engine's attention is in use (model.use_transformer_engine); leave it auto")
        return "te"
    if setting == "local":
        return "local"
    cuda = torch.cuda.is_available()
    if setting == "flash":
        if not cuda:
            raise ValueError("model.attention_backend=flash needs CUDA (torch's flash kernels); use local on CPU")
        if dtype == "float32":
            raise ValueError("model.attention_backend=flash needs model.dtype=bfloat16 or float16")
        return "flash"
    return "flash" if cuda and dtype in ("bfloat16", "float16") else "local"


def _varlen_kwargs() -> tuple[Any, dict[str, Any], bool]:
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    return varlen_attn, causal, "enable_gqa" in params


def flash_dot_product_attention() -> type:
    """The flash core attention class (built on first use: Megatron is imported lazily)."""
    global _CLASS
    if _CLASS is None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        class FlashDotProductAttention(DotProductAttention):
            def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
                super().__init__(cp_attention.init_config(config), *args, **kwargs)  # its own CP: the plan
                self.config = config
                if self.config.attention_dropout:
                    raise ValueError("model.attention_backend=flash runs without attention dropout "
                                     f"(attention_dropout={self.config.attention_dropout})")
                coeff = self.layer_number if getattr(self.config, "apply_query_key_layer_scaling", False) else 1
                self.flash_scale = float(self.softmax_scale) * coeff

            def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                        attn_mask_type: Any = None, attention_bias: Any = None,
                        packed_seq_params: Any = None) -> torch.Tensor:
                if packed_seq_params is not None:
                    return self._packed(query, key, value, packed_seq_params)
                # SBHD: [S, B, heads, dim] → [B, heads, S, dim]
                q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                       scale=self.flash_scale,
                                                                       enable_gqa=k.shape[1] != q.shape[1])
                s, b = query.shape[0], query.shape[1]
                return out.permute(2, 0, 1, 3).reshape(s, b, -1)

            def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        params: Any) -> torch.Tensor:
                # THD: query [T, heads, dim], key/value [T, groups, dim] → output [T, 1, heads·dim]
                varlen_attn, causal, has_gqa = _varlen_kwargs()
                plan = attention_plan.plan_of(params)
                if plan is not None:  # shared prefixes ([prompt; own] keys), context parallelism (gathered)
                    shared = plan.flash_plan
                    key, value = attention_plan.keys_and_values(key, value, plan)
                    key, value = key[shared["k_index"]], value[shared["k_index"]]
                    cu, cu_k = shared["cu_q"], shared["cu_k"]
                    longest, longest_k = int(shared["max_q"]), int(shared["max_k"])
                else:
                    cu = params.cu_seqlens_q.to(torch.int32)
                    longest = params.max_seqlen_q
                    if longest is None:  # one host sync; PackedSeqParams usually carries it
                        longest = int((cu[1:] - cu[:-1]).max())
                    longest = longest_k = int(longest)
                    cu_k = cu
                gqa = key.shape[1] != query.shape[1]
                if gqa and not has_gqa:
                    repeat = query.shape[1] // key.shape[1]
                    key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
                    gqa = False
                extra = {"enable_gqa": True} if gqa else {}
                # causal with fewer queries than keys is aligned at the bottom right (FlashAttention-2's rule)
                out = varlen_attn(query, key, value, cu, cu_k, longest, longest_k, scale=self.flash_scale,
                                  **causal, **extra)
                return out.reshape(out.shape[0], 1, -1)

        _CLASS = FlashDotProductAttention
    return _CLASS
