"""Extension: a GPTModel whose packed rows take their RoPE positions from `position_ids`, explicitly.

  replaces   nothing in place: a subclass of megatron-core's GPTModel overriding `_preprocess` (an
             internal method), which hands the decoder the rotary frequencies of each packed token's
             own position, gathered from `position_ids` (the positions the trainer builds with the
             micro-batch: within each sample, or, with shared prefixes, continuing from the prompt)
  why        for a packed (THD) row Megatron computes frequencies for 0…longest−1 and leaves the
             positions to the rotation, which restarts them at every cu_seqlens boundary; it
             ignores `position_ids` under RoPE. A response that shares its prompt's segment starts at
             |P|, not 0, and context parallelism cuts samples into chunks whose positions are not
             their row offsets. Passing the positions with the tensor Megatron hands the rotation
             (an attribute on cu_seqlens) would vanish with any copy or cast of that tensor
  versions   megatron-core 0.16.1 and 0.19.2 (tested)
  checked    `check()` at start-up: GPTModel._preprocess takes input_ids, position_ids and
             packed_seq_params, and GPTModel keeps its rotary embedding as `rotary_pos_emb`

The frequencies come from the model's own RotaryEmbedding over `max_sequence_length` positions (one
table, Megatron caches it), gathered per token: the rotation (patches/packed_rope.py) then sees one
row of frequencies per token, Megatron's "exact mapping" case. Padded (BSHD) micro-batches keep
Megatron's path: their positions are 0…S−1 anyway.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from megatron_flash.trainer.patches.base import PatchMismatch


@functools.lru_cache(maxsize=None)
def positional_gpt_model() -> type:
    from megatron.core.models.gpt.gpt_model import GPTModel

    class PositionalGPTModel(GPTModel):
        """GPTModel; packed rows' RoPE frequencies from `position_ids` (the module docstring)."""

        def _preprocess(self, *args: Any, **kwargs: Any) -> Any:
            out = super()._preprocess(*args, **kwargs)
            bound = _PREPROCESS.bind(self, *args, **kwargs)
            params, positions = bound.arguments.get("packed_seq_params"), bound.arguments.get("position_ids")
            if out[1] is None or params is None or params.qkv_format != "thd" or positions is None:
                return out
            # [max_len, 1, 1, dim], not sliced for context parallelism (packed_seq): every position
            table = self.rotary_pos_emb(self.max_sequence_length, packed_seq=True)
            return (out[0], table[positions.reshape(-1)], *out[2:])

    _PREPROCESS = inspect.signature(GPTModel._preprocess)
    return PositionalGPTModel


def check() -> None:
    from megatron.core.models.gpt.gpt_model import GPTModel

    params = set(inspect.signature(GPTModel._preprocess).parameters)
    missing = sorted({"input_ids", "position_ids", "packed_seq_params"} - params)
    if missing:
        raise PatchMismatch("GPTModel._preprocess", f"takes no {missing}; patches/explicit_positions.py reads them")
    if "rotary_pos_emb" not in inspect.getsource(GPTModel.__init__):
        raise PatchMismatch("GPTModel", "keeps no rotary_pos_emb module; patches/explicit_positions.py uses it")
