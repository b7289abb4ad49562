"""Megatron layouts agree with each other and with the HF checkpoint (gloo, torchrun, CPU, fp32).

  case       TP  PP  DP  procs  optimizer                what it exercises
  ---------  --  --  --  -----  -----------------------  -------------------------------------------
  ref         1   1   1    1    sgd                      the reference every other row is compared to
  tp2         2   1   1    2    sgd                      vocab-parallel logprobs, QKV/fc1 TP split
  pp2         1   2   1    2    sgd                      P2P schedule, layer offsets, tied embedding
  tp2pp2      2   2   1    4    sgd                      both
  ref_adam    1   1   1    1    adam                     reference for dp2
  dp2         1   1   2    2    adam, distributed optim. micro-batch split across DP, sharded optimizer
  ref_moe     1   1   1    1    sgd                      MoE reference (load-balancing loss off, below)
  ep2         1   1   2    2    sgd                      MoE: 4 of 8 experts per rank, tokens dispatched
  tp2sp_ep2   2   1   2    4    sgd                      MoE: experts split over EP, each over TP (+SP)
  dp2_aux     1   1   2    2    sgd                      MoE reference with the load-balancing loss (0.1)
  ep2_aux     1   1   2    2    sgd                      the same micro-batches at EP2: rows padded to one
                                                         length for the dispatcher, padding masked out

Each case loads the same HF checkpoint, records logprobs of a fixed batch, exports HF right after
load (must equal the source file bit for bit), takes one optimizer step on a fixed weighted-NLL loss
with micro-batch 2 (so the reference accumulates 4 micro-batches and dp2 2 per rank) and exports
again. Equal gradients ⇒ equal SGD updates, so the weights after the step are compared at 1e-5. Megatron's
distributed optimizer only supports Adam, so dp2 is compared with an Adam reference instead. The first
MoE rows run without the load-balancing loss: it is computed per micro-batch over the tokens it holds,
so it is not invariant to how a layout groups samples into micro-batches, while the policy loss is.
ep2_aux and dp2_aux hold the same micro-batches (DP2 both), so with the loss on (coefficient 0.1,
100x the checkpoint's) they must agree too: the EP2 rows carry padding the DP2 rows do not.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import hf_weights
from tests.distributed.grouped_cases import run_layout_cases

CASES = {
    "ref": dict(tp=1, pp=1, nproc=1, extra=[], ref="ref"),
    "tp2": dict(tp=2, pp=1, nproc=2, extra=[], ref="ref"),
    "pp2": dict(tp=1, pp=2, nproc=2, extra=[], ref="ref"),
    "tp2pp2": dict(tp=2, pp=2, nproc=4, extra=[], ref="ref"),
    "ref_adam": dict(tp=1, pp=1, nproc=1, extra=["--optimizer", "adam"], ref="ref_adam"),
    "dp2": dict(tp=1, pp=1, nproc=2, extra=["--optimizer", "adam", "--distributed-optimizer"], ref="ref_adam"),
    "ref_moe": dict(tp=1, pp=1, nproc=1, extra=["--moe-aux", "0"], ref="ref_moe"),
    "ep2": dict(tp=1, pp=1, nproc=2, extra=["--ep", "2", "--moe-aux", "0"], ref="ref_moe"),
    "tp2sp_ep2": dict(tp=2, pp=1, nproc=4, extra=["--ep", "2", "--sp", "--moe-aux", "0"], ref="ref_moe"),
    "dp2_aux": dict(tp=1, pp=1, nproc=2, extra=["--moe-aux", "0.1"], ref="dp2_aux"),
    "ep2_aux": dict(tp=1, pp=1, nproc=2, extra=["--ep", "2", "--moe-aux", "0.1"], ref="dp2_aux"),
}
FAMILY_CASES = {
    "llama": ["ref", "tp2", "pp2", "tp2pp2", "ref_adam", "dp2"],
    "qwen3": ["ref", "tp2", "pp2", "tp2pp2"],
    "qwen2": ["ref", "tp2pp2"],
    "qwen3_moe": ["ref_moe", "ep2", "tp2sp_ep2", "dp2_aux", "ep2_aux"],
}


@pytest.fixture(scope="module")
def layout_runs(tiny_models: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], str]:
    cases = {}
    for family, names in FAMILY_CASES.items():
        for case in names:
            c = CASES[case]
            cases[f"{family}_{case}"] = (c["nproc"], ["--hf-dir", tiny_models[family], "--tp", str(c["tp"]),
                                                      "--pp", str(c["pp"])] + c["extra"])
    out = run_layout_cases(cases, str(tmp_path_factory.mktemp("layouts")))
    return {(family, case): out[f"{family}_{case}"] for family, names in FAMILY_CASES.items() for case in names}


PAIRS = [(f, c) for f, cases in FAMILY_CASES.items() for c in cases if CASES[c]["ref"] != c]


@pytest.mark.parametrize("family,case", PAIRS)
def test_logprobs_match_reference_layout(layout_runs, family: str, case: str) -> None:
    ref = torch.load(os.path.join(layout_runs[(family, CASES[case]["ref"])], "logprobs.pt"))
    got = torch.load(os.path.join(layout_runs[(family, case)], "logprobs.pt"))
    assert got.shape == ref.shape == (8, 16)
    assert (got - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family,case", PAIRS)
def test_one_step_gives_same_weights(layout_runs, family: str, case: str) -> None:
    ref_case = CASES[case]["ref"]
    before = hf_weights(os.path.join(layout_runs[(family, ref_case)], "export0"))
    ref = hf_weights(os.path.join(layout_runs[(family, ref_case)], "export1"))
    got = hf_weights(os.path.join(layout_runs[(family, case)], "export1"))
    assert got.keys() == ref.keys()
    moved = max((ref[k] - before[k]).abs().max().item() for k in ref)
    assert moved > 1e-3, "the optimizer step did not change the weights visibly"
    worst = max((got[k] - ref[k]).abs().max().item() for k in ref)
    assert worst <= 1e-5, f"{family}/{case}: max weight difference after one step {worst}"
    m_ref = json.load(open(os.path.join(layout_runs[(family, ref_case)], "metrics.json")))
    m_got = json.load(open(os.path.join(layout_runs[(family, case)], "metrics.json")))
    assert m_got["loss"] == pytest.approx(m_ref["loss"], rel=1e-5)
    assert m_got["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("family,case", [(f, c) for f, cases in FAMILY_CASES.items() for c in cases])
def test_export_after_load_is_bit_exact(layout_runs, tiny_models, family: str, case: str) -> None:
    source = hf_weights(tiny_models[family])
    exported = hf_weights(os.path.join(layout_runs[(family, case)], "export0"))
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name
