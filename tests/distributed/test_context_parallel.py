"""Context parallelism without Transformer Engine gives CP1's numbers at every layout (gloo, CPU, fp32).

The batch (layout_worker.fixed_batch): 8 samples of 6–16 tokens (a 4-token prompt each), packed; at CP4
every sequence is padded to a multiple of 8, so the 6- and 7-token ones are shorter than 2·CP. Each case
takes TWO optimizer steps (SGD, lr 1, no clipping: the weights after them are the sum of both steps'
gradients) from the same checkpoint, and is compared with its CP1 reference:

  case          procs  layout                                  loss                  compared to
  ------------  -----  --------------------------------------  --------------------  ---------------
  cp1             1    CP1 (reference)                         fixed weighted NLL    —
  cp2             2    CP2                                     fixed weighted NLL    cp1
  cp4             4    CP4 (sequences shorter than 2·CP)       fixed weighted NLL    cp1
  cp2_tp2sp       4    CP2 × TP2 with sequence parallel        fixed weighted NLL    cp1
  cp2_pp2         4    CP2 × PP2                               fixed weighted NLL    cp1
  cp2_recompute   2    CP2, full activation recompute          fixed weighted NLL    cp1
  cp2_vpp2        4    CP2 × PP2 × VPP2 (four-layer model)     fixed weighted NLL    four_cp1
  adam_cp1/_dp2   1/4  Adam (eps 1), CP2 × DP2, distributed    fixed weighted NLL    adam_cp1
                       optimizer sharded over DP × CP
  <loss>          1/2  CP1 / CP2                               every registered loss its CP1
  lora_cp1/_cp2   1/2  LoRA rank 4 (base frozen), CP1 / CP2    fixed weighted NLL    lora_cp1
                       (its adapters compared, not the merged weights)

Compared: the logprobs of the batch before the steps, both steps' losses and the gradient norm
(≤ 1e-6), and every weight after the two steps (≤ 5e-6: fp32 rounding of weights that moved by up to
4.7, see WEIGHTS_TOL).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import hf_weights
from tests.distributed.grouped_cases import run_layout_cases

LOSSES = ("cispo", "decoupled_ppo", "gspo", "ppo", "reinforce", "tis", "topr")  # = losses.list_losses()
BASE = ["--steps", "2", "--lr", "1", "--micro-batch-size", "4"]
ADAM = ["--optimizer", "adam", "--adam-eps", "1"]
CASES = {  # name: (processes, flags, reference)
    "cp1": (1, [], None),
    "cp2": (2, ["--cp", "2"], "cp1"),
    "cp4": (4, ["--cp", "4"], "cp1"),
    "cp2_tp2sp": (4, ["--cp", "2", "--tp", "2", "--sp"], "cp1"),
    "cp2_pp2": (4, ["--cp", "2", "--pp", "2"], "cp1"),
    "cp2_recompute": (2, ["--cp", "2", "--recompute", "full"], "cp1"),
    "four_cp1": (1, ["--hf-dir", "FOUR"], None),
    "cp2_vpp2": (4, ["--hf-dir", "FOUR", "--cp", "2", "--pp", "2", "--vpp", "2"], "four_cp1"),
    "adam_cp1": (1, ADAM, None),
    "adam_cp2_dp2": (4, ADAM + ["--cp", "2", "--distributed-optimizer"], "adam_cp1"),
}
for _loss in LOSSES:
    CASES[f"{_loss}_cp1"] = (1, ["--loss", _loss], None)
    CASES[f"{_loss}_cp2"] = (2, ["--loss", _loss, "--cp", "2"], f"{_loss}_cp1")
LORA = ["--lora-rank", "4", "--lora-b-std", "0.02"]
CASES["lora_cp1"] = (1, LORA, None)
CASES["lora_cp2"] = (2, LORA + ["--cp", "2"], "lora_cp1")
# The weights after two lr-1 steps move by up to 4.7 here; their fp32 rounding under another summation
# order is a few 1e-6: TP2 against TP1 on this batch differs by 2.2e-6 (2026-12-03), CP2 by 1.4e-6,
# CP4 by 2.4e-6 (one embedding entry each). A lost or doubled gradient term would differ by ≥ 1e-2.
WEIGHTS_TOL = 5e-6
PAIRS = [c for c, spec in CASES.items() if spec[2] is not None]


@pytest.fixture(scope="module")
def runs(tiny_models, four_layer_model, tmp_path_factory) -> dict[str, str]:
    cases = {name: (nproc, ["--hf-dir", tiny_models["llama"], *BASE,  # a later --hf-dir wins: the four-layer cases
                            *[four_layer_model if f == "FOUR" else f for f in flags]])
             for name, (nproc, flags, _) in CASES.items()}
    return run_layout_cases(cases, str(tmp_path_factory.mktemp("context_parallel")))


def metrics(path: str) -> dict:
    with open(os.path.join(path, "metrics.json")) as f:
        return json.load(f)


def test_losses_match_the_registry() -> None:
    from megatron_flash.losses import list_losses

    assert sorted(LOSSES) == list_losses()


@pytest.mark.parametrize("case", PAIRS)
def test_context_parallel_equals_cp1_over_two_steps(runs, case: str) -> None:
    ref = CASES[case][2]
    lp_ref, lp = (torch.load(os.path.join(runs[c], "logprobs.pt")) for c in (ref, case))
    assert (lp - lp_ref).abs().max().item() <= 1e-6, case
    m_ref, m = metrics(runs[ref]), metrics(runs[case])
    assert len(m["losses"]) == len(m_ref["losses"]) == 2
    for a, b in zip(m_ref["losses"], m["losses"]):
        assert abs(a - b) <= 1e-6, (m_ref["losses"], m["losses"])
    assert m["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-6, abs=1e-6)
    before, want, got = trained(runs[ref], "export0"), trained(runs[ref], "export1"), trained(runs[case], "export1")
    assert got.keys() == want.keys()
    assert max((want[k] - before[k]).abs().max().item() for k in want) > 1e-3, "the steps did not move the weights"
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= WEIGHTS_TOL, f"{case}: weights after two steps differ from {ref} by {worst}"


def trained(run: str, export: str) -> dict[str, torch.Tensor]:
    """What the steps train: the exported HF weights, or a LoRA run's adapters (its merged weights
    W + s·B·A multiply B's and A's rounding by the other factor)."""
    adapter = os.path.join(run, export, "adapter")
    if os.path.isdir(adapter):
        return load_file(os.path.join(adapter, "adapter_model.safetensors"))
    return hf_weights(os.path.join(run, export))


def test_each_rank_computes_its_share_of_the_padded_tokens(runs) -> None:
    """The rows are split, not replicated. By hand, from fixed_batch's lengths 6, 16, 7, 11, 8, 13, 9, 12
    (82 tokens): padded to multiples of 4 they are 92 tokens, half of them on a CP2 rank; padded to
    multiples of 8, 104, a quarter on a CP4 rank."""
    assert metrics(runs["cp1"])["tokens_computed"] == 82
    assert metrics(runs["cp2"])["tokens_computed"] == 46
    assert metrics(runs["cp4"])["tokens_computed"] == 26
