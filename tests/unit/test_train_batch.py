"""TrainBatch: the typed trainer batch (shapes checked, rows selected per field kind)."""

from __future__ import annotations

import pytest
import torch

from megatron_flash.types import Sample, TrainBatch, collate


def test_collate_fills_the_fields_by_hand() -> None:
    samples = [Sample(prompt_ids=[5, 6], response_ids=[7], behavior_logprobs=[-0.5], reward=1.0, group_id=3),
               Sample(prompt_ids=[8], response_ids=[9, 10], behavior_logprobs=[-1.0, -2.0], group_id=4)]
    b = collate(samples, pad_id=0, advantages=torch.tensor([2.0, -1.0]))
    assert b.tokens.tolist() == [[5, 6, 7], [8, 9, 10]] and b.lengths.tolist() == [3, 3]
    assert b.loss_mask.tolist() == [[0, 0, 1], [0, 1, 1]]
    assert b.behavior_logprobs.tolist() == [[0, 0, -0.5], [0, -1.0, -2.0]]
    assert b.advantages.tolist() == [[0, 0, 2.0], [0, -1.0, -1.0]]
    assert b.rewards.tolist() == [1.0, 0.0] and b.group_ids.tolist() == [3, 4]
    assert b.proximal_logprobs is None and b.staleness is None


def test_rows_select_every_present_field_and_keep_absent_ones_absent() -> None:
    b = TrainBatch(tokens=torch.arange(6).view(3, 2), loss_mask=torch.ones(3, 2), rewards=torch.tensor([1., 2., 3.]))
    r = b.rows(torch.tensor([2, 0]))
    assert r.tokens.tolist() == [[4, 5], [0, 1]] and r.rewards.tolist() == [3.0, 1.0] and r.advantages is None
    assert [name for name, _ in r.fields()] == ["tokens", "loss_mask", "rewards"]
    cut = b.map(lambda t: t[:, :1], lambda t: t * 10, drop=("rewards",))
    assert cut.tokens.shape == (3, 1) and cut.rewards is None


def test_shapes_are_checked_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"TrainBatch.loss_mask must have shape \(2, 3\)"):
        TrainBatch(tokens=torch.zeros(2, 3, dtype=torch.long), loss_mask=torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"TrainBatch.rewards must have shape \(2,\)"):
        TrainBatch(tokens=torch.zeros(2, 3, dtype=torch.long), loss_mask=torch.zeros(2, 3), rewards=torch.zeros(3))
