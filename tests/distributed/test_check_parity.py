"""tools/check_parity.py: Megatron vs transformers logits on the same weights, per family (fp32)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_tool


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
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


def test_parity_sequence_parallel_on_the_local_spec(tiny_models: dict[str, str]) -> None:
    """Sequence parallel without TE or Apex (the trainer's own RMSNorm), packed rows split over TP."""
    result = last_json(run_tool(["tools/check_parity.py", "--hf-dir", tiny_models["qwen3"], "--tp", "2", "--sp",
                                 "--pack", "--batch", "5"], nproc=2))
    assert result["sp"] and result["tp"] == 2 and result["max_abs_logprob_diff"] <= 1e-4


@pytest.mark.parametrize("layout,nproc", [(["--ep", "2"], 2), (["--tp", "2", "--sp", "--ep", "2"], 4)],
                         ids=["ep2", "tp2-sp-ep2"])
def test_parity_moe_expert_parallel(tiny_models: dict[str, str], layout: list[str], nproc: int) -> None:
    """Qwen3-MoE with its 8 experts split over 2 ranks (each expert whole, or each also split over TP)."""
    result = last_json(run_tool(["tools/check_parity.py", "--hf-dir", tiny_models["qwen3_moe"], *layout],
                                nproc=nproc))
    assert result["family"] == "qwen3_moe" and result["ep"] == 2
    assert result["max_abs_logit_diff"] <= 1e-4 and result["max_abs_logprob_diff"] <= 1e-4


def last_json(proc) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_parity_packed_samples(tiny_models: dict[str, str], family: str) -> None:
    """Samples of different lengths packed in one row vs transformers on each sample alone."""
    result = last_json(run_tool(["tools/check_parity.py", "--hf-dir", tiny_models[family], "--pack", "--batch", "5"]))
    assert result["pack"] and len(set(result["lengths"])) > 1
    assert result["max_abs_logit_diff"] <= 1e-4
    assert result["max_abs_logprob_diff"] <= 1e-4


@pytest.fixture(scope="module")
def four_layer_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("four_layer_models")
    out = {}
    for family in ("llama", "qwen2", "qwen3"):
        out[family] = str(root / family)
        run_tool(["tools/make_tiny_model.py", "--out", out[family], "--arch", family, "--num-layers", "4"])
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_parity_interleaved_pipeline(four_layer_models: dict[str, str], family: str) -> None:
    """PP2 × VPP2 (each rank holds two non-adjacent layers), packed, vs transformers."""
    result = last_json(run_tool(["tools/check_parity.py", "--hf-dir", four_layer_models[family], "--pp", "2",
                                 "--vpp", "2", "--pack"], nproc=2))
    assert (result["pp"], result["vpp"]) == (2, 2)
    assert result["max_abs_logit_diff"] <= 1e-4
    assert result["max_abs_logprob_diff"] <= 1e-4
