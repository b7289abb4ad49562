"""Run checkpoints are layout-independent (Megatron dist_checkpointing): a checkpoint saved by a TP1×PP1
run resumes under TP2, PP2 and DP2 (distributed optimizer), and the next Adam step equals the
uninterrupted run's — loss and every exported weight within 1e-5 (fp32, gloo). Adam (lr 1e-2, warm-up
schedule) makes the comparison sensitive to the optimizer moments and the LR schedule, not only the
weights: a resume that lost them would move the weights differently by ~lr.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.grouped_cases import launch_grouped

CASES = {"tp2": (["--tp", "2"], ""), "pp2": (["--pp", "2"], ""),
         "dp2_distributed_optimizer": (["--distributed-optimizer"], "--distributed-optimizer")}
WORKER = "tests/distributed/ckpt_layout_worker.py"


def weights(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


@pytest.fixture(scope="module")
def saved(tiny_models, tmp_path_factory) -> dict[str, str]:
    """One uninterrupted TP1 run per optimizer kind: step A, checkpoint, step B (one launch for both)."""
    root = str(tmp_path_factory.mktemp("saved"))
    kinds = {"plain": [], "distributed": ["--distributed-optimizer"]}
    launch_grouped(WORKER, {kind: (1, ["--hf-dir", tiny_models["llama"], "--mode", "save", "--ckpt-dir",
                                       os.path.join(root, kind, "ckpt"), "--out", os.path.join(root, kind, "out"),
                                       *flag]) for kind, flag in kinds.items()}, root)
    return {kind: os.path.join(root, kind) for kind in kinds}


@pytest.fixture(scope="module")
def resumed(tiny_models, saved, tmp_path_factory) -> dict[str, str]:
    """Each case's resume in its own layout, every case in one 2-process launch → case → its --out."""
    root = str(tmp_path_factory.mktemp("resumed"))
    cases = {}
    for case, (extra, dist_flag) in CASES.items():
        ckpt = os.path.join(saved["distributed" if dist_flag else "plain"], "ckpt")
        cases[case] = (2, ["--hf-dir", tiny_models["llama"], "--mode", "resume", "--ckpt-dir", ckpt,
                           "--out", os.path.join(root, case), *extra])
    launch_grouped(WORKER, cases, root)
    return {case: os.path.join(root, case) for case in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_under_another_layout_continues_the_same_run(saved, resumed, case: str) -> None:
    root = saved["distributed" if CASES[case][1] else "plain"]
    out = resumed[case]
    with open(os.path.join(root, "out", "metrics.json")) as f:
        ref = json.load(f)
    assert ref["children_after_save"] == 0  # no writer/queue process outlives the save
    with open(os.path.join(out, "metrics.json")) as f:
        got = json.load(f)
    assert (got["saved_tp"], got["saved_pp"]) == (1, 1) and got["rollout_probe"] == 1
    assert got["lr"] == pytest.approx(ref["lr"], rel=1e-12)  # the LR schedule resumed mid-warm-up
    assert abs(got["loss_b"] - ref["loss_b"]) <= 1e-5, (got, ref)
    before, after = (weights(os.path.join(root, "out", d)) for d in ("export_before", "export_after"))
    resumed_weights = weights(os.path.join(out, "export_after"))
    assert resumed_weights.keys() == after.keys()
    moved = max((after[k] - before[k]).abs().max().item() for k in after)
    assert moved > 1e-3  # step B really changed the weights: the comparison below is not vacuous
    assert max((resumed_weights[k] - after[k]).abs().max().item() for k in after) <= 1e-5
