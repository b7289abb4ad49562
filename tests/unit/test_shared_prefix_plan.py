"""Shared-prefix units and rows, worked by hand (trainer/shared_prefix.py; no Megatron)."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from megatron_flash.trainer.packing import MicroBatch, SampleTooLong, Unit, plan_micro_batches
from megatron_flash.trainer.shared_prefix import PromptMismatch, UnsharedWarning, row_layout, shared_units, sharing


def batch() -> tuple[torch.Tensor, list[int], list[int], list[int]]:
    """Group 0: prompt [1, 2, 3] with responses [4, 5], [6], [7, 8, 9]; group 1: prompt [10, 11], response [12]."""
    rows = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 3, 7, 8, 9], [10, 11, 12]]
    tokens = torch.zeros(4, 6, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = torch.tensor(r)
    return tokens, [len(r) for r in rows], [3, 3, 3, 2], [0, 0, 0, 1]


def test_units_share_the_prompt_and_split_by_budget_and_cap() -> None:
    tokens, lengths, prompts, groups = batch()
    assert shared_units(tokens, lengths, prompts, groups, max_tokens=0, max_samples=8) == [
        Unit((0, 1, 2), 3), Unit((3,), 0)]  # a unit of one is laid out as usual
    # budget 8: 3 + 2 + 1 = 6 fits, + 3 = 9 does not → the third sample starts a unit of its own
    assert shared_units(tokens, lengths, prompts, groups, max_tokens=8, max_samples=8) == [
        Unit((0, 1), 3), Unit((2,), 0), Unit((3,), 0)]
    assert shared_units(tokens, lengths, prompts, groups, max_tokens=0, max_samples=2) == [
        Unit((0, 1), 3), Unit((2,), 0), Unit((3,), 0)]
    with pytest.raises(SampleTooLong, match="sample 2 has 6 tokens"):
        shared_units(tokens, lengths, prompts, groups, max_tokens=5, max_samples=8)


def test_samples_of_a_group_must_start_with_the_same_prompt() -> None:
    tokens, lengths, prompts, groups = batch()
    tokens[1, 2] = 99
    with pytest.raises(PromptMismatch, match="samples 0 and 1 of group 0 have different prompt tokens"):
        shared_units(tokens, lengths, prompts, groups, max_tokens=0, max_samples=8)
    tokens, lengths, prompts, groups = batch()
    with pytest.raises(PromptMismatch):
        shared_units(tokens, lengths, [3, 2, 3, 2], groups, max_tokens=0, max_samples=8)


def test_plan_counts_physical_tokens() -> None:
    tokens, lengths, prompts, groups = batch()
    units = shared_units(tokens, lengths, prompts, groups, max_tokens=0, max_samples=8)
    (mb,), = plan_micro_batches(lengths, dp_size=1, max_samples=8, units=units, pad_multiple=4)
    assert mb.indices == (0, 1, 2, 3) and mb.segments == ((3, 3), (1, 0))
    assert mb.physical_lengths() == [3 + 2 + 1 + 3, 3] and mb.num_tokens == 12 and mb.row_len == 12
    assert mb.segment_lengths() == [9, 3]


def test_row_layout_by_hand() -> None:
    tokens, lengths, prompts, groups = batch()
    mb = MicroBatch(indices=(0, 1, 2, 3), lengths=tuple(lengths), row_len=13, segments=((3, 3), (1, 0)))
    lay = row_layout(mb, tokens, width=6)
    #           P  P  P  R0 R0 R1 R2 R2 R2 | s3       | pad
    assert lay.tokens[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0]
    assert lay.positions[0].tolist() == [0, 1, 2, 3, 4, 3, 3, 4, 5, 0, 1, 2, 0]
    # sample 1's first response token (column 3) is predicted by the prompt's last position (2), where
    # the row holds sample 0's next token: extra 0 (index 13 + 0); likewise sample 2 (extra 1)
    assert lay.extra_src.tolist() == [2, 2] and lay.extra_rows.tolist() == [1, 2] and lay.extra_cols.tolist() == [3, 3]
    assert lay.index[0, :5].tolist() == [0, 1, 2, 3, 4]
    assert lay.index[1, :4].tolist() == [0, 1, 2, 13]
    assert lay.index[2, :6].tolist() == [0, 1, 2, 14, 7, 8]
    assert lay.index[3, :3].tolist() == [9, 10, 11]
    assert lay.valid.sum(1).tolist() == lengths
    # attention: the prompt, each response on [prompt; own], sample 3 and the padding on themselves
    flash = lay.flash_plan
    assert flash["cu_q"].tolist() == [0, 3, 5, 6, 9, 12, 13]
    assert flash["cu_k"].tolist() == [0, 3, 8, 12, 18, 21, 22]
    assert flash["k_index"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 0, 1, 2, 6, 7, 8, 9, 10, 11, 12]
    shapes = {(q.shape[0], k.shape[0]): (q.T.tolist(), None if m is None else m.tolist()) for q, k, m in lay.local_plan}
    assert set(shapes) == {(3, 3), (2, 5), (1, 4), (3, 6), (1, 1)}
    assert shapes[(3, 3)] == ([[0, 1, 2], [9, 10, 11]], None)  # the prompt and sample 3, batched, plain causal
    assert shapes[(1, 4)] == ([[5]], [[False, False, False, False]])
    F, T = False, True
    assert shapes[(2, 5)] == ([[3, 4]], [[F, F, F, F, T], [F, F, F, F, F]])
    assert shapes[(3, 6)] == ([[6, 7, 8]], [[F, F, F, F, T, T], [F, F, F, F, F, T], [F, F, F, F, F, F]])


def test_shared_flops_by_hand() -> None:
    """Prefix 3, samples of 5 and 4 tokens: 3 + 2 + 1 = 6 tokens through the matmuls; attention pairs
    3·4/2 = 6 (the prefix), 2·3 + 2·3/2 = 9 and 1·3 + 1 = 4 (the responses) = 19, against 9 tokens and
    15 + 10 pairs unshared."""
    from megatron_flash.hf.spec import HFModelSpec
    from megatron_flash.trainer.flops import matmul_weights_per_token, shared_flops, train_flops

    spec = HFModelSpec(family="llama", architecture="LlamaForCausalLM", vocab_size=100, hidden_size=16,
                       ffn_hidden_size=24, num_layers=2, num_attention_heads=4, num_query_groups=2, head_dim=4,
                       norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=False,
                       qkv_bias=False, qk_norm=False)
    n, ad = matmul_weights_per_token(spec), 16
    assert shared_flops(spec, 3, [5, 4]) == 6 * n * 6 + 12 * ad * 19 * 2
    assert shared_flops(spec, 0, [5]) == train_flops(spec, [5])  # nothing shared: the usual count
    assert train_flops(spec, [5, 4]) == 6 * n * 9 + 12 * ad * 25 * 2


def _spec():
    from megatron_flash.hf.spec import HFModelSpec

    return HFModelSpec(family="llama", architecture="LlamaForCausalLM", vocab_size=100, hidden_size=16,
                       ffn_hidden_size=24, num_layers=2, num_attention_heads=4, num_query_groups=2, head_dim=4,
                       norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=False,
                       qkv_bias=False, qk_norm=False)


def test_saved_fraction_by_hand() -> None:
    """batch(): 18 tokens; group 0's prompt of 3 is computed once instead of three times: 6 saved."""
    tokens, lengths, prompts, groups = batch()
    b = types.SimpleNamespace(tokens=tokens, group_ids=torch.tensor(groups), prompt_lengths=torch.tensor(prompts))
    full = sharing(_spec(), b, lengths, max_tokens=0, max_samples=8)
    assert full.saved_frac == pytest.approx(6 / 18) and full.unshared == "" and full.flops is not None
    assert sharing(_spec(), b, lengths, max_tokens=8, max_samples=8).saved_frac == pytest.approx(3 / 18)
    apart = sharing(_spec(), b, lengths, max_tokens=0, max_samples=1)
    assert apart.saved_frac == 0.0 and "no group has two samples" in apart.unshared
    bare = sharing(_spec(), types.SimpleNamespace(tokens=tokens, group_ids=None, prompt_lengths=None), lengths,
                   max_tokens=0, max_samples=8)
    assert bare.saved_frac == 0.0 and bare.flops is None and "no group_ids or prompt_lengths" in bare.unshared


def test_unshared_batches_warn_first_and_then_every_hundredth(caplog: pytest.LogCaptureFixture) -> None:
    warn = UnsharedWarning()
    with caplog.at_level(logging.WARNING, logger="megatron_flash.trainer.shared_prefix"):
        warn("")  # something shared: no line, not counted
        for _ in range(150):
            warn("a reason")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "shares nothing: a reason (1 such batches so far)" in lines[0]
    assert "(101 such batches so far)" in lines[1]
    caplog.clear()
    quiet = UnsharedWarning(enabled=False)  # not rank 0
    quiet("a reason")
    assert not caplog.records and quiet.count == 1
