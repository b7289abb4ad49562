"""Run checkpoints are layout-independent (Megatron dist_checkpointing): a checkpoint saved by a TP1×PP1
run resumes under TP2, PP2, DP2 (distributed optimizer) and CP2 (with and without it: the optimizer
then shards over DP × CP), and the next Adam step equals the uninterrupted run's — loss and every exported weight within 1e-5 (fp32, gloo). Adam (lr 1e-2, warm-up
schedule) makes the comparison sensitive to the optimizer moments and the LR schedule, not only the
weights: a resume that lost them would move the weights differently by ~lr.

LoRA (rank 4, base frozen): the checkpoint holds only the adapters and their Adam state and names its
base; it resumes under TP2, PP2 and DP2 alike, and the step after it moves A and B as the uninterrupted
run does (fresh B = 0, so the first step moved only B: the resumed step is the first to move A).

A chain across context-parallel sizes, CP2 → CP1 → CP4 (each saving where the next resumes), ends on the
weights of the uninterrupted CP2 run, with and without the distributed optimizer.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.grouped_cases import launch_grouped

CASES = {"tp2": (["--tp", "2"], "plain"), "pp2": (["--pp", "2"], "plain"),
         "dp2_distributed_optimizer": (["--distributed-optimizer"], "distributed"),
         "cp2": (["--cp", "2"], "plain"),
         "cp2_distributed_optimizer": (["--cp", "2", "--distributed-optimizer"], "distributed"),
         "lora_tp2": (["--tp", "2", "--lora-rank", "4"], "lora"), "lora_pp2": (["--pp", "2", "--lora-rank", "4"], "lora"),
         "lora_dp2_distributed_optimizer": (["--distributed-optimizer", "--lora-rank", "4"], "lora_distributed")}
KINDS = {"plain": [], "distributed": ["--distributed-optimizer"], "lora": ["--lora-rank", "4"],
         "lora_distributed": ["--distributed-optimizer", "--lora-rank", "4"]}
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
    launch_grouped(WORKER, {kind: (1, ["--hf-dir", tiny_models["llama"], "--mode", "save", "--ckpt-dir",
                                       os.path.join(root, kind, "ckpt"), "--out", os.path.join(root, kind, "out"),
                                       *flag]) for kind, flag in KINDS.items()}, root)
    return {kind: os.path.join(root, kind) for kind in KINDS}


@pytest.fixture(scope="module")
def resumed(tiny_models, saved, tmp_path_factory) -> dict[str, str]:
    """Each case's resume in its own layout, every case in one 2-process launch → case → its --out."""
    root = str(tmp_path_factory.mktemp("resumed"))
    cases = {}
    for case, (extra, kind) in CASES.items():
        ckpt = os.path.join(saved[kind], "ckpt")
        cases[case] = (2, ["--hf-dir", tiny_models["llama"], "--mode", "resume", "--ckpt-dir", ckpt,
                           "--out", os.path.join(root, case), *extra])
    cases.update(chain_cases(tiny_models, "cp2", chain_paths(root)))  # the same launch: 2 processes
    launch_grouped(WORKER, cases, root)
    return {case: os.path.join(root, case) for case in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_under_another_layout_continues_the_same_run(saved, resumed, case: str) -> None:
    root = saved[CASES[case][1]]
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


def test_lora_checkpoint_holds_only_adapters_and_names_its_base(saved, tiny_models) -> None:
    from megatron_flash.hf.adapters import base_fingerprint
    from megatron_flash.trainer.checkpoint import latest_checkpoint

    def size(path: str) -> int:
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)

    full, lora = (latest_checkpoint(os.path.join(saved[k], "ckpt")) for k in ("plain", "lora"))
    with open(os.path.join(lora, "meta.json")) as f:
        meta = json.load(f)["lora"]
    assert meta["base"] == os.path.abspath(tiny_models["llama"])
    assert meta["base_fingerprint"] == base_fingerprint(tiny_models["llama"])
    assert (meta["rank"], meta["targets"]) == (4, ["qkv", "proj", "fc1", "fc2"])
    # Adam state and weights of 6,656 adapter parameters against 97,088: well under a fifth of the bytes.
    assert size(os.path.join(lora, "trainer")) * 5 < size(os.path.join(full, "trainer"))


def test_checkpoint_of_another_kind_or_base_is_refused(saved, seed1_model, tiny_models) -> None:
    """A LoRA checkpoint on a run without LoRA, and on another base, stops with one line naming both."""
    from tests.conftest import run_tool

    code = ("import sys; sys.path.insert(0, '.')\n"
            "from megatron_flash.trainer import checkpoint as c\n"
            "from megatron_flash.trainer.policy import MegatronPolicy, PolicySettings\n"
            "from megatron_flash.trainer.lora import LoraOptions\n"
            "path = c.latest_checkpoint(sys.argv[1])\n"
            "for hf, rank in ((sys.argv[2], 0), (sys.argv[3], 4)):\n"
            "    try:\n"
            "        c.load(MegatronPolicy(PolicySettings(hf_path=hf, lora=LoraOptions(rank=rank))), path)\n"
            "    except ValueError as e:\n"
            "        print('REFUSED', e)\n"
            "    from megatron_flash.trainer.distributed import destroy_distributed; destroy_distributed()\n")
    out = run_tool(["-c", code, os.path.join(saved["lora"], "ckpt"), tiny_models["llama"], seed1_model]).stdout
    lines = [line for line in out.splitlines() if line.startswith("REFUSED")]
    assert len(lines) == 2, out
    assert "holds LoRA adapters; this run trains full weights" in lines[0]
    assert "is another model" in lines[1] and os.path.abspath(seed1_model) in lines[1]


CHAIN_KINDS = {"plain": [], "distributed": ["--distributed-optimizer"]}
# stage → (processes = CP size, mode, checkpoint it reads, seeds of its steps, the checkpoint it saves)
CHAIN = {"cp2": (2, "save", "ckpt", "2,3", ""), "cp1": (1, "resume", "ckpt", "2", "ckpt_cp1"),
         "cp4": (4, "resume", "ckpt_cp1", "3", "")}


def chain_paths(root: str) -> dict[str, dict[str, str]]:
    return {kind: {name: os.path.join(root, "cp_chain", kind, name) for name in ("ckpt", "ckpt_cp1", *CHAIN)}
            for kind in CHAIN_KINDS}


def chain_cases(tiny_models, stage: str, paths) -> dict[str, tuple[int, list[str]]]:
    cp, mode, source, seeds, resave = CHAIN[stage]
    return {f"chain_{kind}_{stage}": (cp, [
        "--hf-dir", tiny_models["llama"], "--mode", mode, "--cp", str(cp), "--ckpt-dir", paths[kind][source],
        "--out", paths[kind][stage], "--batches", seeds, *(["--resave-dir", paths[kind][resave]] if resave else []),
        *flag]) for kind, flag in CHAIN_KINDS.items()}


@pytest.fixture(scope="module")
def cp_chain(tiny_models, resumed) -> dict[str, dict[str, str]]:
    """CP2 → CP1 → CP4: an uninterrupted CP2 run (step A, checkpoint, steps B and C: saved in `resumed`'s
    2-process launch); a CP1 run resumes its checkpoint, takes step B and saves; a CP4 run resumes that and
    takes step C. With the distributed optimizer the Adam state is sharded over DP × CP: 2, then 1, then 4
    shards."""
    root = os.path.dirname(next(iter(resumed.values())))
    paths = chain_paths(root)
    for stage in ("cp1", "cp4"):  # one launch each: each needs the checkpoint of the one before
        launch_grouped(WORKER, chain_cases(tiny_models, stage, paths), root)
    return paths


@pytest.mark.parametrize("kind", list(CHAIN_KINDS))
def test_a_checkpoint_resumes_across_a_change_of_context_parallel_size(cp_chain, kind: str) -> None:
    p = cp_chain[kind]
    read = {}
    for stage in ("cp2", "cp1", "cp4"):
        with open(os.path.join(p[stage], "metrics.json")) as f:
            read[stage] = json.load(f)
    ref, cp1, cp4 = read["cp2"], read["cp1"], read["cp4"]
    assert (cp1["saved_cp"], cp4["saved_cp"]) == (2, 1)  # each resumed a checkpoint of the other size
    assert len(ref["losses"]) == 2 and ref["losses"][0] != ref["losses"][1]
    assert abs(cp1["losses"][0] - ref["losses"][0]) <= 1e-5, (cp1, ref)  # step B at CP1
    assert abs(cp4["losses"][0] - ref["losses"][1]) <= 1e-5, (cp4, ref)  # step C at CP4
    before, after = (weights(os.path.join(p["cp2"], d)) for d in ("export_before", "export_after"))
    chained = weights(os.path.join(p["cp4"], "export_after"))
    assert chained.keys() == after.keys()
    assert max((after[k] - before[k]).abs().max().item() for k in after) > 1e-3  # B and C moved the weights
    assert max((chained[k] - after[k]).abs().max().item() for k in after) <= 1e-5
