"""The pure pieces of the labelled-version check (trainer/version_check.py) and the token-level
staleness metric: which token carries which label, and weight copies swapped in and out bit-exactly.
The check itself, against a real trainer and engine, is tests/e2e/test_version_labels.py."""

from __future__ import annotations

import torch

from megatron_flash.recipes import token_staleness
from megatron_flash.trainer.version_check import WeightSnapshots, token_labels
from megatron_flash.types import Sample, collate


def samples() -> list[Sample]:
    return [
        # one version throughout (token_versions None): every token is version_end's
        Sample([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], version_start=3, version_end=4),
        # spanned a push: per-token versions, the last one unknown
        Sample([1], [6, 7, 8, 9], [-0.1] * 4, version_start=2, version_end=3, token_versions=[2, 2, 3, -1]),
        # multi-turn: the observation token (mask 0) is not trained
        Sample([1], [6, 7, 8], [-0.1] * 3, version_start=4, version_end=4, response_mask=[1, 0, 1]),
    ]


def test_token_labels_place_each_version_on_its_token() -> None:
    s = samples()
    batch = collate(s, pad_id=0)
    labels, mixed = token_labels(s, batch, mixed_after_push=False)
    # rows: prompt and padding get −1; by hand from the samples above
    assert labels.tolist() == [[-1, -1, 4, 4, 4],
                               [-1, 2, 2, 3, -1],
                               [-1, 4, -1, 4, -1]]
    assert not mixed.any()


def test_in_place_tokens_after_a_push_are_marked_mixed() -> None:
    s = samples()
    batch = collate(s, pad_id=0)
    labels, mixed = token_labels(s, batch, mixed_after_push=True)
    assert labels[1].tolist() == [-1, 2, 2, 3, -1]
    # only version 3 came after a push onto v2's KV; the unknown one (−1 < 2) is not "later"
    assert mixed.tolist() == [[False] * 5, [False, False, False, True, False], [False] * 5]


def test_token_staleness_counts_trained_tokens_of_known_version() -> None:
    # step version 5: lags 1,1,1 | 3,3,2 | 1,1 (the observation and the unknown token left out)
    out = token_staleness(samples(), 5)
    assert out["staleness_token_mean"] == sum([1, 1, 1, 3, 3, 2, 1, 1]) / 8
    assert out["staleness_token_max"] == 3
    assert token_staleness([], 5) == {"staleness_token_mean": None, "staleness_token_max": None}


def test_snapshots_swap_in_and_restore_bit_exactly() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    snaps = WeightSnapshots([model])
    snaps.take(0)
    at_v0 = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    at_v1 = [p.detach().clone() for p in model.parameters()]
    snaps.take(1)
    x = torch.randn(5, 4)
    with snaps.swapped(0):
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), at_v0))
        y0 = model(x)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), at_v1))
    assert not torch.equal(y0, model(x))
    snaps.drop_before(1)
    assert snaps.versions == [1]
