"""trainer/patches/packed_rope.py against Megatron-Core's own THD RoPE on CPU (fp32): packed rows of several samples,
frequencies for the longest sample (positions restart per sample) and one row per token (exact
mapping), plain and interleaved rotation, and a tail of padding as its own segment."""

from __future__ import annotations

import pytest
import torch


class _Group:  # what Megatron reads of a context-parallel group: size 1, rank 0
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_packed_rope_equals_megatrons(per_token: bool, interleaved: bool) -> None:
    from megatron_flash.trainer.patches import packed_rope as rope

    g = torch.Generator().manual_seed(0)
    lengths = [3, 7, 1, 5, 4]  # the last one stands for a padding tail
    rows, heads, dim = sum(lengths), 4, 8
    t = torch.randn(rows, heads, dim, generator=g)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    freqs = torch.randn(rows if per_token else max(lengths), 1, 1, dim, generator=g)
    ours = rope.apply_rotary_pos_emb_thd(t, cu, freqs, rotary_interleaved=interleaved, cp_group=_Group())
    theirs = rope.original()(t, cu, freqs, rotary_interleaved=interleaved, cp_group=_Group())
    assert torch.allclose(ours, theirs, atol=1e-6, rtol=0)
    if not per_token:  # positions restart: the second sample's first token is rotated like position 0
        first = rope.apply_rotary_pos_emb_thd(t[3:4], cu.new_tensor([0, 1]), freqs, rotary_interleaved=interleaved,
                                              cp_group=_Group())
        assert torch.allclose(ours[3:4], first, atol=1e-6)


def test_install_routes_megatron_through_it() -> None:
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_flash.trainer.patches import packed_rope as rope

    rope.install()
    rope.install()
    assert rope_utils._apply_rotary_pos_emb_thd is rope.apply_rotary_pos_emb_thd
    assert rope.original() is not rope.apply_rotary_pos_emb_thd
