"""tools/check_parity.py: Megatron vs transformers logits on the same weights, per family (fp32)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_tool


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_parity_tp1(tiny_models: dict[str, str], family: str) -> None:
    proc = run_tool(["tools/check_parity.py", "--hf-dir", tiny_models[family]])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["family"] == family
    assert result["max_abs_logit_diff"] <= 1e-4
    assert result["max_abs_logprob_diff"] <= 1e-4


def test_parity_tp2_pp2_under_torchrun(tiny_models: dict[str, str]) -> None:
    proc = run_tool(["tools/check_parity.py", "--hf-dir", tiny_models["qwen2"], "--tp", "2", "--pp", "2"], nproc=4)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["tp"], result["pp"]) == (2, 2)
    assert result["max_abs_logit_diff"] <= 1e-4
