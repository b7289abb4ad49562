"""RoPE for packed rows without a host round trip per sample.

Megatron-Core's unfused THD path (`rope_utils._apply_rotary_pos_emb_thd`, used whenever RoPE fusion is
off, i.e. without Transformer Engine) reads every sample's length to the host (`.tolist()`, and
`.item()` per sample when the frequencies are per token), splits the row, slices the frequencies per
sample and concatenates them: on a GPU, one synchronisation and O(samples) small kernels in every
attention layer of every micro-batch.

Here the frequencies of the whole row come from one gather on the device: position-in-sample =
index − start of its sample, the starts spread over the row by `repeat_interleave(…, output_size=T)`
(the output size given, so torch need not read the lengths back). Then one rotation of the row, the
same function Megatron uses for the padded layout. The two cases of Megatron's function are kept:

  freqs has T rows (one per token of the row)     → freqs as they are (Megatron's "exact mapping")
  freqs has the longest length's rows              → freqs[position within the sample] (positions
                                                     restart at every sample: what packing needs)

Context parallelism (cp > 1) keeps Megatron's function (each rank holds two chunks per sample); the
trainer refuses cp > 1 anyway. `install()` swaps the function in once; tests/unit/test_rope.py
compares it with Megatron's on CPU.
"""

from __future__ import annotations

from typing import Any

import torch

_ORIGINAL: Any = None


def apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
                             rotary_interleaved: bool = False, multi_latent_attention: bool = False,
                             mscale: float = 1.0, cp_group: Any = None) -> torch.Tensor:
    """t [T, heads, dim], cu_seqlens [samples + 1] (the last equals T), freqs [F, 1, 1, dim]."""
    from megatron.core.models.common.embeddings import rope_utils

    if cp_group is not None and cp_group.size() > 1:
        return _ORIGINAL(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                         multi_latent_attention=multi_latent_attention, mscale=mscale, cp_group=cp_group)
    rows = t.shape[0]
    if freqs.size(0) == rows:
        packed = freqs
    else:
        cu = cu_seqlens.to(device=t.device, dtype=torch.long)
        starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=rows)
        packed = freqs[torch.arange(rows, device=t.device) - starts]
    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), packed, rotary_interleaved=rotary_interleaved,
                                                 multi_latent_attention=multi_latent_attention,
                                                 mscale=mscale).squeeze(1)


def install() -> None:
    """Route Megatron's unfused THD RoPE through `apply_rotary_pos_emb_thd` (idempotent)."""
    global _ORIGINAL
    from megatron.core.models.common.embeddings import rope_utils

    if _ORIGINAL is None:
        _ORIGINAL = rope_utils._apply_rotary_pos_emb_thd
        rope_utils._apply_rotary_pos_emb_thd = apply_rotary_pos_emb_thd


def original() -> Any:
    """Megatron's own function (for comparison)."""
    from megatron.core.models.common.embeddings import rope_utils

    return _ORIGINAL if _ORIGINAL is not None else rope_utils._apply_rotary_pos_emb_thd
