"""The packing plan and the packed-row helpers (pure; expected values worked out by hand)."""

from __future__ import annotations

import pytest
import torch

from megatron_flash.trainer.micro_batches import BatchingOptions, build_micro_batches
from megatron_flash.types import TrainBatch
from megatron_flash.trainer.packing import (
    MicroBatch,
    SampleTooLong,
    cu_seqlens,
    packed_inputs,
    plan_micro_batches,
    unpack_index,
)


def rows(plan: list[list[MicroBatch]]) -> list[list[tuple[tuple[int, ...], int]]]:
    return [[(m.indices, m.row_len) for m in rank] for rank in plan]


def test_worked_example_of_the_module_docstring() -> None:
    plan = plan_micro_batches([9, 2, 7, 3, 5, 1], dp_size=2, max_tokens=10, max_samples=99)
    assert rows(plan) == [[((0,), 9), ((3, 1), 5)], [((2, 5), 8), ((4,), 5)]]


def test_every_sample_once_and_budget_held() -> None:
    lengths = [int(x) for x in torch.randint(1, 50, (40,), generator=torch.Generator().manual_seed(0))]
    plan = plan_micro_batches(lengths, dp_size=3, max_tokens=60, max_samples=5)
    seen = sorted(i for rank in plan for m in rank for i in m.indices)
    assert seen == list(range(40))
    for rank in plan:
        for m in rank:
            assert sum(lengths[i] for i in m.indices) <= 60 and len(m.indices) <= 5
    loads = [sum(m.num_tokens for m in rank) for rank in plan]
    assert max(loads) - min(loads) <= max(lengths)  # greedy longest-first bound


def test_equal_rows_pad_multiple_and_fillers() -> None:
    plan = plan_micro_batches([5, 3, 2], dp_size=4, max_tokens=0, max_samples=1, pad_multiple=4, equal_rows=True)
    # 3 samples on 4 ranks: rank 3 gets a filler; every row padded to the longest (5 → 8).
    assert [len(r) for r in plan] == [1, 1, 1, 1]
    assert [r[0].row_len for r in plan] == [8, 8, 8, 8]
    assert [r[0].filler for r in plan] == [False, False, False, True]
    counted = plan_micro_batches([5, 3, 2], dp_size=1, max_tokens=0, max_samples=1, min_micro_batches=2,
                                 micro_batch_multiple=2)[0]
    assert len(counted) == 4 and sum(m.filler for m in counted) == 1


def test_sample_longer_than_budget_is_an_error_naming_it() -> None:
    with pytest.raises(SampleTooLong, match="sample 1 has 30 tokens .* trainer.max_tokens_per_micro_batch=20"):
        plan_micro_batches([10, 30], dp_size=1, max_tokens=20, max_samples=4)
    batch = TrainBatch(tokens=torch.zeros(2, 30, dtype=torch.long), lengths=torch.tensor([10, 30]),
                       loss_mask=torch.zeros(2, 30))
    with pytest.raises(SampleTooLong, match="sample 1 has 30 tokens .* trainer.max_seq_len=16"):
        build_micro_batches(batch, BatchingOptions(max_seq_len=16), dp_rank=0, dp_size=1, device=torch.device("cpu"))


def test_cu_seqlens_by_hand() -> None:
    assert cu_seqlens([2, 1, 2], torch.device("cpu")).tolist() == [0, 2, 3, 5]


def test_packed_row_positions_and_unpack() -> None:
    tokens = torch.tensor([[11, 12, 13, 0], [21, 22, 0, 0]])
    mb = MicroBatch(indices=(1, 0), lengths=(2, 3), row_len=7)
    row, pos = packed_inputs(mb, tokens, pad_id=0)
    assert row.tolist() == [[21, 22, 11, 12, 13, 0, 0]]
    assert pos.tolist() == [[0, 1, 0, 1, 2, 0, 1]]
    index, valid = unpack_index(mb, 3)
    assert index.tolist() == [[0, 1, 0], [2, 3, 4]]
    assert valid.tolist() == [[True, True, False], [True, True, True]]


def test_micro_batch_fields_are_the_loss_view() -> None:
    batch = TrainBatch(tokens=torch.arange(12).view(3, 4), lengths=torch.tensor([4, 2, 3]),
                       loss_mask=torch.ones(3, 4), rewards=torch.tensor([1.0, 2.0, 3.0]))
    (m,) = build_micro_batches(batch, BatchingOptions(micro_batch_size=8), dp_rank=0, dp_size=1,
                               device=torch.device("cpu"))
    assert m.tokens.tolist() == [[0, 1, 2, 3, 8, 9, 10, 4, 5]]  # longest first: 4, 3, 2 tokens
    assert m.fields.rewards.tolist() == [1.0, 3.0, 2.0]
    assert m.fields.tokens.shape == (3, 4) and m.fields.lengths is None
    lp = torch.arange(1.0, 10.0).view(1, 9)
    assert m.unpack(lp).tolist() == [[0, 2, 3, 4], [0, 6, 7, 0], [0, 9, 0, 0]]
    assert m.packed_seq_params.cu_seqlens_q.tolist() == [0, 4, 7, 9]


def test_pack_lays_loss_view_rows_where_their_tokens_sit() -> None:
    """Micro.pack, unpack's inverse: a per-token row of values (e.g. a teacher's top-K ids) goes where
    its token sits in the packed row (padded: rows are samples, padded to the row width)."""
    batch = TrainBatch(tokens=torch.arange(12).view(3, 4), lengths=torch.tensor([4, 2, 3]),
                       loss_mask=torch.ones(3, 4))
    (m,) = build_micro_batches(batch, BatchingOptions(micro_batch_size=8), dp_rank=0, dp_size=1,
                               device=torch.device("cpu"))
    values = (m.fields.tokens * 10)[..., None].expand(3, 4, 2).clone()  # [n, w, 2]: 10 × the token, twice
    packed = m.pack(values)
    assert packed[..., 0].tolist() == [[0, 10, 20, 30, 80, 90, 100, 40, 50]] and packed.shape == (1, 9, 2)
    assert m.unpack(packed)[:, 1:].tolist() == values[:, 1:].mul(m.valid[:, 1:, None]).tolist()
    (p,) = build_micro_batches(batch, BatchingOptions(pack=False, micro_batch_size=3, pad_multiple=3),
                               dp_rank=0, dp_size=1, device=torch.device("cpu"))
    assert p.pack(p.fields.tokens[..., None]).shape == (3, 6, 1) and p.tokens.shape == (3, 6)
