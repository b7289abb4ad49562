"""The post-sync probe's pure parts: deterministic tokens, SGLang reply parsing, the diff arithmetic."""

from __future__ import annotations

import pytest
import torch

from megatron_flash.weight_sync import probe


def _reply(tokens: torch.Tensor, prompt_len: int, values: list[list[float]]) -> list[dict]:
    out = []
    for row, vals in zip(tokens.tolist(), values):
        ids = row[prompt_len - 1:]
        out.append({"meta_info": {"input_token_logprobs": [[lp, t, None] for lp, t in zip([None] + vals, ids)]}})
    return out


def test_tokens_are_deterministic_and_inside_the_vocabulary() -> None:
    a, b = probe.probe_tokens(48), probe.probe_tokens(48)
    assert torch.equal(a, b) and a.shape == (probe.NUM_SEQUENCES, probe.PROMPT_LEN + probe.CONTINUATION_LEN)
    assert int(a.min()) >= 1 and int(a.max()) <= 46


def test_parse_drops_sglangs_leading_null_and_checks_ids() -> None:
    tokens = probe.probe_tokens(48, num_sequences=2, prompt_len=3, continuation_len=2)
    values = [[-1.0, -2.0], [-0.5, -0.25]]
    assert probe.parse_continuation_logprobs(_reply(tokens, 3, values), tokens, 3, url="u") == values
    bad = _reply(tokens, 3, values)
    bad[1]["meta_info"]["input_token_logprobs"][2][1] += 1
    with pytest.raises(ValueError, match="sequence 1: .*input_token_logprobs.*scores ids"):
        probe.parse_continuation_logprobs(bad, tokens, 3, url="u")
    short = _reply(tokens, 3, values)
    short[0]["meta_info"]["input_token_logprobs"].pop()
    with pytest.raises(ValueError, match="expected 3"):
        probe.parse_continuation_logprobs(short, tokens, 3, url="u")


def test_diffs_compare_continuation_columns_only() -> None:
    # column t of the trainer's logprobs is token t given tokens < t; prompt columns are ignored
    trainer = torch.tensor([[0.0, 9.0, -1.0, -2.0], [0.0, 9.0, -0.5, -0.25]])
    mx, mean = probe.logprob_diffs(trainer, [[-1.0, -2.5], [-0.5, -0.25]], prompt_len=2)
    assert mx == pytest.approx(0.5) and mean == pytest.approx(0.125)
