"""The static decoder's KV cache and the attention function that reads and writes it.

    k[layer], v[layer]: [num_slots, kv_heads, slot_len, head_dim], allocated once
    a request owns one slot for its whole life; its token t has its K/V at [slot, :, t]

The model is transformers' own class (Llama, Qwen2, Qwen3, Qwen3-MoE, ...): the engine registers
`slot_attention` under the name "mf_slots" and switches the model to it, and every forward passes a
`SlotForward` as the extra keyword `slot_forward`, which transformers hands through the layers to the
attention call. No past_key_values object, so transformers' own cache and mask code stays out; the
4-D mask the decoder passes is returned by transformers' mask builder as it is.

Two kinds of forward:
- prefill: several requests packed into one row [1, ΣT], each from position 0 (a retracted request
  comes back as prompt + generated prefix): its keys are written to [slot, :, :T] and it attends
  causally to itself.
- decode: one token per row for rows 0..B-1 (row r is slot r), each at its own position `pos[r]`:
  the key is written at pos[r], and the row attends over [0, L) of its slot with the mask
  `arange(L) <= pos[r]`. L is a length bucket above the longest row, so a step reads what the rows
  hold, not the whole cache. Query heads are folded onto their KV head ([B, kv_heads, groups, D])
  so one plain SDPA call serves GQA without copying K/V.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.nn.functional as F

ATTENTION_NAME = "mf_slots"


@dataclasses.dataclass
class SlotForward:
    """What one forward of the static decoder needs in every attention layer."""

    cache: "SlotKVCache"
    decode: bool
    rows: int = 0  # decode: rows 0..rows-1 are slots 0..rows-1
    length: int = 0  # decode: attended length bucket L
    write: Optional[torch.Tensor] = None  # decode: [rows] int64, where each row's key goes (its position)
    mask: Optional[torch.Tensor] = None  # decode: [rows, 1, 1, L] bool
    seqs: tuple[tuple[int, int, int], ...] = ()  # prefill: (slot, offset in the packed row, tokens)


class SlotKVCache:
    """Per-layer K/V tensors of `num_slots` slots of `slot_len` tokens each."""

    def __init__(self, *, config: Any, num_slots: int, slot_len: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        text = config.get_text_config()
        heads = int(text.num_attention_heads)
        self.kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        self.head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        self.num_layers = int(text.num_hidden_layers)
        self.num_slots, self.slot_len = num_slots, slot_len
        shape = (num_slots, self.kv_heads, slot_len, self.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(self.num_layers)]
        self.row_index = torch.arange(num_slots, device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def copy_slot(self, src: int, dst: int, num_tokens: int) -> None:
        """Duplicate the first `num_tokens` positions of a slot (requests that share a prompt)."""
        for k, v in zip(self.k, self.v):
            k[dst, :, :num_tokens].copy_(k[src, :, :num_tokens])
            v[dst, :, :num_tokens].copy_(v[src, :, :num_tokens])


def slot_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                   dropout: float = 0.0, *, slot_forward: Optional[SlotForward] = None,
                   **_: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, H, T, D], key/value [B, KV, T, D] (RoPE
    applied) → ([B, T, H, D], None)."""
    if slot_forward is None:  # a plain forward of the same model (teacher-forced scoring, the sync probe)
        causal = attention_mask is None and query.size(2) > 1
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, is_causal=causal,
                                             scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    layer = module.layer_idx
    k_cache, v_cache = slot_forward.cache.k[layer], slot_forward.cache.v[layer]
    if slot_forward.decode:
        return _decode(query, key, value, k_cache, v_cache, slot_forward, scaling), None
    return _prefill(query, key, value, k_cache, v_cache, slot_forward, scaling), None


def _decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, fwd: SlotForward, scaling: Optional[float]) -> torch.Tensor:
    rows, length = fwd.rows, fwd.length
    index = fwd.cache.row_index[:rows]
    k_cache[index, :, fwd.write] = key[:, :, 0].to(k_cache.dtype)
    v_cache[index, :, fwd.write] = value[:, :, 0].to(v_cache.dtype)
    heads, kv_heads, dim = query.size(1), k_cache.size(1), query.size(-1)
    q = query.reshape(rows, kv_heads, heads // kv_heads, dim)  # [B, KV, G, D]: the G heads of a KV head as queries
    out = F.scaled_dot_product_attention(q.to(k_cache.dtype), k_cache[:rows, :, :length],
                                         v_cache[:rows, :, :length], attn_mask=fwd.mask, scale=scaling)
    return out.reshape(rows, 1, heads, dim).to(query.dtype)


def _prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, fwd: SlotForward, scaling: Optional[float]) -> torch.Tensor:
    outs = []
    for slot, offset, tokens in fwd.seqs:
        k, v = key[0, :, offset:offset + tokens], value[0, :, offset:offset + tokens]
        k_cache[slot, :, :tokens] = k.to(k_cache.dtype)
        v_cache[slot, :, :tokens] = v.to(v_cache.dtype)
        outs.append(F.scaled_dot_product_attention(query[:, :, offset:offset + tokens], k[None], v[None],
                                                   is_causal=True, scale=scaling, enable_gqa=True))
    return torch.cat(outs, dim=2).transpose(1, 2)


def install(model: Any) -> None:
    """Register the attention function and switch `model` to it (transformers' AttentionInterface)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, slot_attention)
    # Only reached without a 4-D mask (the decoder always passes one); registered so that the name is valid.
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    model.set_attn_implementation(ATTENTION_NAME)
