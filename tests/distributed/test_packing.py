"""Packed micro-batches train exactly like padded ones, under every layout (gloo, torchrun, CPU, fp32).

  model     case              procs  layout       batching                          compared to
  --------  ----------------  -----  -----------  --------------------------------  -----------
  2 layers  padded              1    TP1          pad to the longest, 2 per mb      (reference)
  2 layers  packed              1    TP1          packed rows, ≤ 2 samples per mb   padded
  2 layers  budget              1    TP1          packed, ≤ 24 tokens per mb        padded
  2 layers  tp2                 2    TP2          packed, ≤ 24 tokens               padded
  2 layers  pp2                 2    PP2          packed, rows padded to one shape  padded
  2 layers  dp2                 2    DP2          packed, balanced by tokens        padded
  2 layers  recompute_full      1    TP1          packed, full recompute 1 layer    padded
  2 layers  recompute_sel       1    TP1          packed, selective recompute       padded
  4 layers  pp1                 1    TP1          packed, ≤ 24 tokens               (reference)
  4 layers  vpp2                2    PP2 × VPP2   packed (interleaved 1F1B)         pp1
  4 layers  vpp2_padded         2    PP2 × VPP2   padded                            pp1

The batch (layout_worker.fixed_batch) holds 8 samples of 6..16 tokens in a [8, 16] tensor. One SGD
step with lr = 1 and no clipping moves each weight by exactly its gradient, so equal weights after
the step (1e-5) mean equal gradients on every parameter; the loss must agree to 1e-5 as well, and
logprobs before the step to 1e-5.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import hf_weights
from tests.distributed.grouped_cases import run_layout_cases

LENGTHS = [6, 16, 7, 11, 8, 13, 9, 12]  # layout_worker.fixed_batch, written out independently
BUDGET = ["--max-tokens", "24"]
CASES = {
    "padded": ("two", 1, ["--no-pack"], None),
    "packed": ("two", 1, [], "padded"),
    "budget": ("two", 1, BUDGET, "padded"),
    "tp2": ("two", 2, ["--tp", "2"] + BUDGET, "padded"),
    "pp2": ("two", 2, ["--pp", "2"] + BUDGET, "padded"),
    "dp2": ("two", 2, BUDGET, "padded"),
    "recompute_full": ("two", 1, ["--recompute", "full"] + BUDGET, "padded"),
    "recompute_sel": ("two", 1, ["--recompute", "selective"], "padded"),
    "pp1": ("four", 1, BUDGET, None),
    "vpp2": ("four", 2, ["--pp", "2", "--vpp", "2"] + BUDGET, "pp1"),
    "vpp2_padded": ("four", 2, ["--pp", "2", "--vpp", "2", "--no-pack"], "pp1"),
}


@pytest.fixture(scope="module")
def runs(tiny_models, four_layer_model, tmp_path_factory) -> dict[str, str]:
    models = {"two": tiny_models["llama"], "four": four_layer_model}
    cases = {case: (nproc, ["--hf-dir", models[model], "--lr", "1", "--micro-batch-size", "2"] + extra)
             for case, (model, nproc, extra, _) in CASES.items()}
    return run_layout_cases(cases, str(tmp_path_factory.mktemp("packing")))


def metrics(path: str) -> dict[str, float]:
    with open(os.path.join(path, "metrics.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("case", [c for c, spec in CASES.items() if spec[3] is not None])
def test_same_loss_logprobs_and_gradients(runs, case: str) -> None:
    ref = CASES[case][3]
    got, want = metrics(runs[case]), metrics(runs[ref])
    assert abs(got["loss"] - want["loss"]) <= 1e-5, (got["loss"], want["loss"])
    lp_got = torch.load(os.path.join(runs[case], "logprobs.pt"))
    lp_ref = torch.load(os.path.join(runs[ref], "logprobs.pt"))
    for i, n in enumerate(LENGTHS):  # past a sample's length the padded run scores pad tokens
        assert (lp_got[i, :n] - lp_ref[i, :n]).abs().max().item() <= 1e-5, f"sample {i}"
    before = hf_weights(os.path.join(runs[ref], "export0"))
    want_w, got_w = hf_weights(os.path.join(runs[ref], "export1")), hf_weights(os.path.join(runs[case], "export1"))
    assert set(got_w) == set(want_w)
    moved = max((want_w[k] - before[k]).abs().max().item() for k in want_w)
    assert moved > 1e-3, "the step did not move the weights"
    worst = max((got_w[k] - want_w[k]).abs().max().item() for k in want_w)
    assert worst <= 1e-5, f"{case}: a gradient differs from {ref} by {worst}"


def test_packing_computes_only_real_tokens(runs) -> None:
    """Padded: 8 rows × 16; packed without PP: exactly the samples' tokens; PP2 pads rows to one shape."""
    assert metrics(runs["padded"])["tokens_computed"] == 8 * 16
    assert metrics(runs["packed"])["tokens_computed"] == sum(LENGTHS)
    assert metrics(runs["budget"])["tokens_computed"] == sum(LENGTHS)
    # Each micro-batch ≤ 24 tokens: at least ceil(82 / 24) = 4 of them.
    assert metrics(runs["budget"])["micro_batches"] >= 4
    pp2 = metrics(runs["pp2"])
    assert sum(LENGTHS) <= pp2["tokens_computed"] <= pp2["micro_batches"] * 24
