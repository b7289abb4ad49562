"""Packed (THD) sequences on Megatron's local layer spec: core attention one sample at a time.

Megatron-Core runs packed rows (`PackedSeqParams`, `qkv_format="thd"`, `cu_seqlens`) through Transformer
Engine's attention only; its local `DotProductAttention` refuses them. Everything else on the packed
path is Megatron's own and spec-independent: SelfAttention squeezes q/k/v to [T, heads, dim] and
applies RoPE per sample from `cu_seqlens` (positions restart at every boundary). So the local spec
needs only a core attention that honours the boundaries, and then CPU, CI and GPUs without TE run the
very code path TE runs.

This one cuts the row at `cu_seqlens` and runs Megatron's own DotProductAttention (scaled, causal,
GQA-expanded) on each sample, batching samples of equal length into one call. Attention therefore
costs Σ l² for samples of lengths l, as with TE, not T² for the row: a block-diagonal mask over the
whole row would spend most of its time on masked-out pairs when many short samples share a row.

Shared prefixes (trainer/shared_prefix.py) and context parallelism (trainer/context_parallel.py) bring a
plan of their own (trainer/attention_plan.py, built on the host with the micro-batch): per shape, the rows' query and key positions of the sequences batched
together, and for a response the bottom-right causal mask over [its prompt's keys; its own] (query
i sees the prompt and its own first i + 1 tokens): Megatron's DotProductAttention with that mask
computes, for each response token, the very scores and softmax of the unshared sample's row.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import torch

from megatron_flash.trainer import attention_plan
from megatron_flash.trainer.patches import cp_attention

_CLASS: Optional[type] = None


def packed_dot_product_attention() -> type:
    """The local-spec core attention class (built on first use: Megatron is imported lazily)."""
    global _CLASS
    if _CLASS is None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        class PackedDotProductAttention(DotProductAttention):
            def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
                super().__init__(cp_attention.init_config(config), *args, **kwargs)  # its own CP: the plan
                self.config = config

            def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                        attn_mask_type: Any = None, attention_bias: Any = None,
                        packed_seq_params: Any = None) -> torch.Tensor:
                if packed_seq_params is None:
                    return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                           attention_bias=attention_bias)
                plan = attention_plan.plan_of(packed_seq_params)
                if plan is not None:  # shared prefixes, context parallelism
                    key, value = attention_plan.keys_and_values(key, value, plan)
                    out = query.new_empty(query.shape[0], 1, query.shape[1] * query.shape[2])
                    for q_index, k_index, mask in plan.local_plan:
                        context = super().forward(query[q_index], key[k_index], value[k_index], mask,
                                                  attn_mask_type=attn_mask_type)  # [sq, b, heads·dim]
                        out[q_index.reshape(-1), 0] = context.reshape(q_index.numel(), -1)
                    return out
                # THD: query [T, heads, dim], key/value [T, groups, dim] → output [T, 1, heads·dim]
                bounds = packed_seq_params.cu_seqlens_q.tolist()
                by_length: dict[int, list[int]] = defaultdict(list)
                for start, end in zip(bounds[:-1], bounds[1:]):
                    if end > start:
                        by_length[end - start].append(start)
                out = query.new_empty(query.shape[0], 1, query.shape[1] * query.shape[2])
                for length, starts in by_length.items():
                    # [length, n, heads, dim]: the samples of this length side by side as a batch
                    index = (torch.tensor(starts, device=query.device)[None, :]
                             + torch.arange(length, device=query.device)[:, None])
                    context = super().forward(query[index], key[index], value[index], None,
                                              attn_mask_type=attn_mask_type)  # [length, n, heads·dim]
                    out[index.reshape(-1), 0] = context.reshape(length * len(starts), -1)
                return out

        _CLASS = PackedDotProductAttention
    return _CLASS
