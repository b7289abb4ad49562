"""trainer/context_parallel.py worked by hand: the chunks each CP rank holds, the order an all-gather
gives back, and the attention plans (local and flash) against causal attention over the whole row."""

from __future__ import annotations

import pytest
import torch

from megatron_flash.trainer.context_parallel import chunk_owner, padded, split


def test_chunks_go_to_rank_r_and_its_mirror() -> None:
    assert [chunk_owner(k, 2) for k in range(4)] == [0, 1, 1, 0]
    assert [chunk_owner(k, 4) for k in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert padded(5, 2) == 8 and padded(8, 2) == 8 and padded(1, 4) == 8 and padded(0, 2) == 0


def test_the_example_of_the_module_docstring() -> None:
    r0, r1 = split([8], cp_size=2, rank=0), split([8], cp_size=2, rank=1)
    assert r0.local_index.tolist() == [0, 1, 6, 7] and r1.local_index.tolist() == [2, 3, 4, 5]
    gathered = torch.cat([r0.local_index, r1.local_index])  # what the all-gather of the positions gives
    assert gathered[r0.gather_order].tolist() == list(range(8))
    # rank 0: chunk 0 (2 queries over keys 0-1), chunk 3 (2 queries over keys 0-7)
    assert r0.flash_plan["cu_q"].tolist() == [0, 2, 4] and r0.flash_plan["cu_k"].tolist() == [0, 2, 10]
    assert gathered[r0.flash_plan["k_index"]].tolist() == [0, 1] + list(range(8))


def test_several_sequences_and_an_empty_one() -> None:
    lengths = [8, 0, 4]  # CP 2: chunks of 2 and of 1
    parts = [split(lengths, cp_size=2, rank=r) for r in range(2)]
    assert parts[0].local_index.tolist() == [0, 1, 6, 7, 8, 11]
    assert parts[1].local_index.tolist() == [2, 3, 4, 5, 9, 10]
    gathered = torch.cat([p.local_index for p in parts])
    assert gathered[parts[0].gather_order].tolist() == list(range(12))
    with pytest.raises(ValueError, match="not a multiple of 2·CP = 4"):
        split([6], cp_size=2, rank=0)


def _attend(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    scores = (q @ k.T).masked_fill(mask, float("-inf"))
    return torch.softmax(scores, -1) @ k


@pytest.mark.parametrize("cp_size", [2, 4])
def test_the_plans_give_causal_attention_of_the_whole_sequences(cp_size: int) -> None:
    """Each rank's plan over the gathered keys reproduces, for its local queries, causal attention
    within each sequence of the whole row (values = keys here, one head)."""
    lengths = [2 * cp_size * 3, 2 * cp_size, 0, 2 * cp_size * 2]
    total = sum(lengths)
    x = torch.randn(total, 4, generator=torch.Generator().manual_seed(0))
    want = torch.empty_like(x)
    start = 0
    for n in lengths:  # reference: causal attention per sequence
        if n:
            seq = x[start:start + n]
            want[start:start + n] = _attend(seq, seq, torch.ones(n, n).triu(1).bool())
        start += n
    parts = [split(lengths, cp_size=cp_size, rank=r) for r in range(cp_size)]
    gathered = torch.cat([x[p.local_index] for p in parts])
    pairs = []
    for p in parts:
        local = x[p.local_index]
        got = torch.empty_like(local)
        for q_index, k_index, mask in p.local_plan:
            for b in range(q_index.shape[1]):
                got[q_index[:, b]] = _attend(local[q_index[:, b]], gathered[k_index[:, b]], mask)
        assert torch.allclose(got, want[p.local_index], atol=1e-6)
        cu_q, cu_k, k_index = p.flash_plan["cu_q"], p.flash_plan["cu_k"], p.flash_plan["k_index"]
        flat = torch.empty_like(local)
        for i in range(len(cu_q) - 1):
            q = local[cu_q[i]:cu_q[i + 1]]
            keys = gathered[k_index[cu_k[i]:cu_k[i + 1]]]
            sq, sk = len(q), len(keys)
            flat[cu_q[i]:cu_q[i + 1]] = _attend(q, keys, torch.arange(sk)[None] > (sk - sq) + torch.arange(sq)[:, None])
        assert torch.allclose(flat, want[p.local_index], atol=1e-6)
        pairs.append(p.attention_pairs)
    # every rank computes the same number of (query, key) pairs: chunks r and 2·CP−1−r balance
    assert len(set(pairs)) == 1
    assert sum(pairs) == sum(n * (n + 1) // 2 for n in lengths)
