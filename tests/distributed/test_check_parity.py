"""tools/check_parity.py: Megatron vs transformers logits on the same weights, per family (fp32).

Every check of the module runs through parity_worker.py, one launch per process count (grouped_cases):
each case builds its own policy and transformers model, as a launch of the tool would.
"""

from __future__ import annotations

import pytest

from tests.conftest import json_rows, make_tiny_models
from tests.distributed.grouped_cases import launch_grouped

FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe"]
INTERLEAVED = ["llama", "qwen2", "qwen3"]  # the four-layer models: PP2 × VPP2 needs 4 layers
MOE_LAYOUTS = {"ep2": (["--ep", "2"], 2), "tp2-sp-ep2": (["--tp", "2", "--sp", "--ep", "2"], 4)}


@pytest.fixture(scope="module")
def four_layer_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("four_layer_models")
    out = {family: str(root / family) for family in INTERLEAVED}
    make_tiny_models([["--out", path, "--arch", family, "--num-layers", "4"] for family, path in out.items()])
    return out


@pytest.fixture(scope="module")
def parity(tiny_models, four_layer_models, tmp_path_factory) -> dict[str, dict]:
    """case name → the tool's JSON summary of that check."""
    cases: dict[str, tuple[int, list[str]]] = {}
    for family in FAMILIES:
        cases[f"tp1-{family}"] = (1, ["--hf-dir", tiny_models[family]])
        cases[f"packed-{family}"] = (1, ["--hf-dir", tiny_models[family], "--pack", "--batch", "5"])
    cases["tp2pp2"] = (4, ["--hf-dir", tiny_models["qwen2"], "--tp", "2", "--pp", "2"])
    cases["sp"] = (2, ["--hf-dir", tiny_models["qwen3"], "--tp", "2", "--sp", "--pack", "--batch", "5"])
    for name, (layout, nproc) in MOE_LAYOUTS.items():
        cases[f"moe-{name}"] = (nproc, ["--hf-dir", tiny_models["qwen3_moe"], *layout])
    for family in INTERLEAVED:
        cases[f"interleaved-{family}"] = (2, ["--hf-dir", four_layer_models[family], "--pp", "2", "--vpp", "2",
                                              "--pack"])
    stdout = launch_grouped("tests/distributed/parity_worker.py", cases, str(tmp_path_factory.mktemp("parity")))
    results = {r["case"]: r for r in json_rows(stdout)}
    assert sorted(results) == sorted(cases), stdout[-3000:]
    return results


def checked(parity: dict[str, dict], case: str) -> dict:
    """The case's summary; `ok` is the tool's own verdict (both diffs within its tolerance, 1e-4),
    what its exit code said when each check was a launch of its own."""
    result = parity[case]
    assert result["ok"] and result["tol"] == 1e-4, result
    return result


@pytest.mark.parametrize("family", FAMILIES)
def test_parity_tp1(parity, family: str) -> None:
    result = checked(parity, f"tp1-{family}")
    assert result["family"] == family
    assert result["max_abs_logit_diff"] <= 1e-4
    assert result["max_abs_logprob_diff"] <= 1e-4


def test_parity_tp2_pp2_under_torchrun(parity) -> None:
    result = checked(parity, "tp2pp2")
    assert (result["tp"], result["pp"]) == (2, 2)
    assert result["max_abs_logit_diff"] <= 1e-4


def test_parity_sequence_parallel_on_the_local_spec(parity) -> None:
    """Sequence parallel without TE or Apex (the trainer's own RMSNorm), packed rows split over TP."""
    result = checked(parity, "sp")
    assert result["sp"] and result["tp"] == 2 and result["max_abs_logprob_diff"] <= 1e-4


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_parity_moe_expert_parallel(parity, layout: str) -> None:
    """Qwen3-MoE with its 8 experts split over 2 ranks (each expert whole, or each also split over TP)."""
    result = checked(parity, f"moe-{layout}")
    assert result["family"] == "qwen3_moe" and result["ep"] == 2
    assert result["max_abs_logit_diff"] <= 1e-4 and result["max_abs_logprob_diff"] <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_parity_packed_samples(parity, family: str) -> None:
    """Samples of different lengths packed in one row vs transformers on each sample alone."""
    result = checked(parity, f"packed-{family}")
    assert result["pack"] and len(set(result["lengths"])) > 1
    assert result["max_abs_logit_diff"] <= 1e-4
    assert result["max_abs_logprob_diff"] <= 1e-4


@pytest.mark.parametrize("family", INTERLEAVED)
def test_parity_interleaved_pipeline(parity, family: str) -> None:
    """PP2 × VPP2 (each rank holds two non-adjacent layers), packed, vs transformers."""
    result = checked(parity, f"interleaved-{family}")
    assert (result["pp"], result["vpp"]) == (2, 2)
    assert result["max_abs_logit_diff"] <= 1e-4
    assert result["max_abs_logprob_diff"] <= 1e-4
