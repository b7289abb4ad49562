"""Patch: megatron-core's unfused THD RoPE, for packed rows without a host round trip per sample.

  replaces   megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_thd (the module
             attribute `apply_rotary_pos_emb` looks up; Megatron has no extension point for it)
  why        Megatron's version (used whenever RoPE fusion is off, i.e. without Transformer Engine)
             reads every sample's length to the host (`.tolist()`, and `.item()` per sample when the
             frequencies are per token), splits the row, slices the frequencies per sample and
             concatenates them: on a GPU, one synchronisation and O(samples) small kernels in every
             attention layer of every micro-batch
  versions   megatron-core 0.16.1 and 0.19.2 (tested); the MLA flag is `multi_latent_attention` in
             0.16 and `mla_rotary_interleaved` from 0.17 on, both taken
  checked    `check()` (= check_signatures) at start-up and again at install: the function replaced
             and the bshd rotation it calls take no argument this module does not know

Here the frequencies of the whole row come from one gather on the device: position-in-sample =
index − start of its sample, the starts spread over the row by `repeat_interleave(…, output_size=T)`
(the output size given, so torch need not read the lengths back). Then one rotation of the row, the
same function Megatron uses for the padded layout. The two cases of Megatron's function are kept:

  freqs has T rows (one per token of the row)     → freqs as they are (Megatron's "exact mapping")
  freqs has the longest length's rows              → freqs[position within the sample] (positions
                                                     restart at every sample: what packing needs)

The trainer's model (patches/explicit_positions.py) hands every packed row per-token frequencies,
gathered from the positions it was given explicitly (within each sample, or continuing from a shared
prompt): the first case.

Under context parallelism the trainer's rows carry per-token frequencies too (each rank's tokens at
their own positions: trainer/context_parallel.py); per-length frequencies under CP keep Megatron's
function. tests/unit/test_rope.py compares this one with Megatron's on CPU.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

from megatron_flash.trainer.patches.base import PatchMismatch

_ORIGINAL: Any = None
# The MLA flag's name in this version's `_apply_rotary_pos_emb_bshd` (set by `check_signatures()`).
_MLA_KEYWORD: Optional[str] = None
_MLA_NAMES = ("mla_rotary_interleaved", "multi_latent_attention")
_THD_KNOWN = frozenset({"t", "cu_seqlens", "freqs", "rotary_interleaved", "mscale", "cp_group", *_MLA_NAMES})
_BSHD_KNOWN = frozenset({"t", "freqs", "rotary_interleaved", "mscale", *_MLA_NAMES})


def check_signatures() -> str:
    """The bshd rotation's keyword for the MLA flag; RuntimeError naming the version and the unknown
    parameters when this megatron-core's RoPE functions are not the ones this module replaces."""
    from megatron.core.models.common.embeddings import rope_utils

    thd = _ORIGINAL if _ORIGINAL is not None else rope_utils._apply_rotary_pos_emb_thd
    for name, fn, known in (("_apply_rotary_pos_emb_thd", thd, _THD_KNOWN),
                            ("_apply_rotary_pos_emb_bshd", rope_utils._apply_rotary_pos_emb_bshd, _BSHD_KNOWN)):
        params = set(inspect.signature(fn).parameters)
        unknown = sorted(params - known)
        if unknown or not params & set(_MLA_NAMES):
            raise PatchMismatch(f"rope_utils.{name}", f"takes {sorted(params)}; the packed RoPE "
                                f"(trainer/patches/packed_rope.py) knows {sorted(known)}, not {unknown}")
    bshd = set(inspect.signature(rope_utils._apply_rotary_pos_emb_bshd).parameters)
    return next(name for name in _MLA_NAMES if name in bshd)


def apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
                             rotary_interleaved: bool = False, mla_rotary_interleaved: bool = False,
                             mscale: float = 1.0, cp_group: Any = None,
                             multi_latent_attention: Optional[bool] = None) -> torch.Tensor:
    """t [T, heads, dim], cu_seqlens [samples + 1] (the last equals T), freqs [F, 1, 1, dim].

    Takes the MLA flag under either name (0.16 passes `multi_latent_attention`, 0.17+
    `mla_rotary_interleaved`) and hands it on under the name this version's rotation takes."""
    global _MLA_KEYWORD
    from megatron.core.models.common.embeddings import rope_utils

    if _MLA_KEYWORD is None:
        _MLA_KEYWORD = check_signatures()
    mla = bool(multi_latent_attention) if multi_latent_attention is not None else mla_rotary_interleaved
    flag = {_MLA_KEYWORD: mla}
    rows = t.shape[0]
    if freqs.size(0) == rows:  # per-token frequencies (the trainer's, under context parallelism too)
        packed = freqs
    elif cp_group is not None and cp_group.size() > 1:
        return _ORIGINAL(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved, mscale=mscale,
                         cp_group=cp_group, **flag)
    else:
        cu = cu_seqlens.to(device=t.device, dtype=torch.long)
        starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=rows)
        packed = freqs[torch.arange(rows, device=t.device) - starts]
    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), packed, rotary_interleaved=rotary_interleaved,
                                                 mscale=mscale, **flag).squeeze(1)


def install() -> None:
    """Route Megatron's unfused THD RoPE through `apply_rotary_pos_emb_thd` (idempotent). Checks the
    signatures first: an unknown megatron-core RoPE is refused here, at model build."""
    global _ORIGINAL, _MLA_KEYWORD
    from megatron.core.models.common.embeddings import rope_utils

    _MLA_KEYWORD = check_signatures()
    if _ORIGINAL is None:
        _ORIGINAL = rope_utils._apply_rotary_pos_emb_thd
        rope_utils._apply_rotary_pos_emb_thd = apply_rotary_pos_emb_thd


def original() -> Any:
    """Megatron's own function (for comparison)."""
    from megatron.core.models.common.embeddings import rope_utils

    return _ORIGINAL if _ORIGINAL is not None else rope_utils._apply_rotary_pos_emb_thd


def check() -> None:
    check_signatures()
