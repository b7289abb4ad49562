"""The compat tier: the product on another megatron-core than CI's lock (`make test-compat`).

    make test-compat                      # the newest release (requirements/compat-newest.txt)
    make test-compat MCORE_VERSION=0.18.2 # another one, installed the same way

The Makefile runs this module with the interpreter of .cache/compat/megatron-core-<version>/ (that
release in front of the locked set, tools/compat/install.sh) and sets MF_COMPAT_MCORE to the version
it built; every subprocess here starts from sys.executable, so torchrun ranks and engine servers run
on the same megatron-core. What it covers, at CI size (≤ 5 minutes on the 2-core box):

  parity       Megatron vs transformers logits (fp32): TP1, TP2, PP2, each padded and packed
  quickstart   the CPU quickstart, 20 async RL steps: export parity and a rising reward
  resume       the quickstart's distributed checkpoint resumed for 4 more steps: each step in the
               ledger once, no prompt trained twice
  weight sync  tools/weight_sync/verify.py with ipc, broadcast and disk: the engine serves the new
               weights after each
  LoRA         adapter steps at TP2 + SP and PP2 against TP1; an adapter checkpoint resumed under TP2
  layouts      shared-prefix packing (TP1, PP2), a MoE model at EP2, PP2 × VPP2, each against its reference
"""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import REPO, json_rows, run_tool
from tests.distributed.grouped_cases import launch_grouped

QUICKSTART_STEPS, SAVE_EVERY, RESUMED_STEPS = 20, 10, 4


def test_the_tier_runs_on_the_megatron_core_it_was_built_for() -> None:
    from megatron_flash.versions import installed

    want = os.environ.get("MF_COMPAT_MCORE")
    if not want:
        pytest.fail("MF_COMPAT_MCORE is not set: run this tier with `make test-compat`")
    assert installed("megatron-core") == want


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The quickstart, 20 RL steps, a distributed checkpoint every 10: its JSON summary (+ `out`)."""
    out = str(tmp_path_factory.mktemp("compat") / "qs")
    proc = run_tool(["launch/quickstart_cpu.py", "--out", out, f"trainer.total_steps={QUICKSTART_STEPS}",
                     f"checkpoint.save_dir={out}/ckpt", f"checkpoint.save_interval={SAVE_EVERY}",
                     "checkpoint.save_hf_at_end=false", "logging.wandb_mode=disabled", "logging.tensorboard=false"],
                    timeout=420)
    summary = json_rows(proc.stdout)[-1]
    return {**summary, "out": out}


def test_parity_tp1_tp2_pp2_padded_and_packed(quickstart: dict, tmp_path) -> None:
    model = os.path.join(quickstart["out"], "tiny_model")
    layouts = {"tp1": (1, []), "tp2": (2, ["--tp", "2"]), "pp2": (2, ["--pp", "2"])}
    cases = {}
    for name, (nproc, flags) in layouts.items():
        cases[f"{name}-padded"] = (nproc, ["--hf-dir", model, *flags])
        cases[f"{name}-packed"] = (nproc, ["--hf-dir", model, *flags, "--pack", "--batch", "5"])
    results = {r["case"]: r for r in json_rows(launch_grouped("tests/distributed/parity_worker.py", cases,
                                                              str(tmp_path)))}
    assert sorted(results) == sorted(cases)
    for name, result in results.items():
        assert result["ok"] and result["max_abs_logit_diff"] <= 1e-4 and result["max_abs_logprob_diff"] <= 1e-4, \
            (name, result)
    assert (results["tp2-packed"]["tp"], results["pp2-packed"]["pp"]) == (2, 2)


def test_quickstart_learns(quickstart: dict) -> None:
    assert quickstart["rl_steps"] == QUICKSTART_STEPS
    assert quickstart["export_max_abs_logit_diff"] <= 1e-4
    # sort4 from a format-only warm-up: chance is 1/24; after 20 steps on 0.16.1 the last five steps
    # average 0.2-0.3 (docs/benchmarks.md). A run whose trainer does not learn stays near 0.04.
    assert quickstart["reward_last5"] >= quickstart["reward_first5"] + 0.08, quickstart
    assert quickstart["staleness_max"] <= 2


def _ledger(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "trained_prompts.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_a_distributed_checkpoint_resumes_exactly(quickstart: dict) -> None:
    out = quickstart["out"]
    run_dir = os.path.join(out, "rl")
    before = _ledger(run_dir)
    assert [r["step"] for r in before] == list(range(QUICKSTART_STEPS))
    total = QUICKSTART_STEPS + RESUMED_STEPS
    run_tool(["launch/pretrain_async_rl.py", "--config", "configs/quickstart_cpu.yaml",
              f"model.hf_path={out}/warm_model", f"logging.dir={run_dir}", f"trainer.total_steps={total}",
              f"checkpoint.save_dir={out}/ckpt", "checkpoint.resume=true", "checkpoint.save_hf_at_end=false",
              "logging.wandb_mode=disabled", "logging.tensorboard=false"], timeout=300)
    after = _ledger(run_dir)
    assert after[:QUICKSTART_STEPS] == before  # the saved steps are kept as they were
    assert [r["step"] for r in after] == list(range(total))  # and the run went on from the last save
    trained = [i for r in after for i in r["prompt_indices"]]
    assert len(trained) == len(set(trained))  # no prompt trained twice across the resume
    assert [r["version"] for r in after] == [s + 1 for s in range(total)]


def test_weight_sync_verify_with_every_transport(quickstart: dict) -> None:
    model = os.path.join(quickstart["out"], "tiny_model")
    proc = run_tool(["tools/weight_sync/verify.py", "--model-path", model, "--transport", "ipc",
                     "--transport", "broadcast", "--transport", "disk"], timeout=300)
    rows = [r for r in json_rows(proc.stdout) if "max_abs_logprob_diff" in r]
    assert [r["transport"] for r in rows] == ["ipc", "broadcast", "disk"], proc.stdout[-2000:]
    for r in rows:
        assert r["max_abs_logprob_diff"] <= 1e-4, r
        # Just before the sync the engine served the previous weights: a sync that delivered nothing
        # would leave a diff this large.
        assert r["stale_max_abs_logprob_diff"] > 100 * max(r["max_abs_logprob_diff"], 1e-6), r


def test_lora_layouts_and_resume(tiny_models, tmp_path) -> None:
    """LoRA on this megatron-core: one SGD step of the adapters at TP2 + SP and PP2 equals TP1 (1e-6), and a
    TP1 adapter checkpoint resumes under TP2 (the next Adam step equals the uninterrupted run's, 1e-5)."""
    from tests.distributed.grouped_cases import run_layout_cases
    from tests.distributed.test_lora_layouts import adapter

    lora = ["--hf-dir", tiny_models["llama"], "--lora-rank", "4", "--lora-b-std", "0.05", "--lr", "1",
            "--max-tokens", "24"]
    runs = run_layout_cases({"ref": (1, lora), "tp2sp": (2, lora + ["--tp", "2", "--sp"]),
                             "pp2": (2, lora + ["--pp", "2"])}, str(tmp_path / "layouts"))
    want = adapter(os.path.join(runs["ref"], "export1", "adapter"))
    before = adapter(os.path.join(runs["ref"], "export0", "adapter"))
    assert max((want[k] - before[k]).abs().max().item() for k in want) > 1e-3
    for case in ("tp2sp", "pp2"):
        got = adapter(os.path.join(runs[case], "export1", "adapter"))
        assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-6, case

    worker, ckpt = "tests/distributed/ckpt_layout_worker.py", str(tmp_path / "ckpt")
    common = ["--hf-dir", tiny_models["llama"], "--ckpt-dir", ckpt, "--lora-rank", "4"]
    launch_grouped(worker, {"save": (1, common + ["--mode", "save", "--out", str(tmp_path / "save")])}, str(tmp_path))
    launch_grouped(worker, {"tp2": (2, common + ["--mode", "resume", "--tp", "2", "--out", str(tmp_path / "tp2")])},
                   str(tmp_path))
    saved, resumed = (adapter(str(tmp_path / d / "export_after" / "adapter")) for d in ("save", "tp2"))
    assert max((resumed[k] - saved[k]).abs().max().item() for k in saved) <= 1e-5


def test_shared_prefix_moe_and_interleaved_pipeline(tiny_models, four_layer_model, tmp_path) -> None:
    """This megatron-core under the trainer's other layouts, each against its reference (fp32, gloo):

      case              procs  layout                           compared to   tolerance
      sp_shared           1    shared prefix, ≤ 24 tokens       sp_plain      two SGD steps (lr 1): 1e-6
      sp_pp2_shared       2    shared prefix under PP2          sp_plain      two SGD steps (lr 1): 1e-6
      moe_ep2             2    Qwen3-MoE, EP2 (aux loss off)    moe_ref       one SGD step: 1e-5
      vpp2                2    PP2 × VPP2, 4-layer Llama        vpp_ref       one SGD step (lr 1): 1e-6
    """
    import torch

    from tests.conftest import hf_weights
    from tests.distributed.grouped_cases import run_layout_cases

    shared = ["--hf-dir", tiny_models["llama"], "--grouped", "--steps", "2", "--lr", "1", "--micro-batch-size", "8",
              "--max-tokens", "24"]
    moe = ["--hf-dir", tiny_models["qwen3_moe"], "--moe-aux", "0"]
    four = ["--hf-dir", four_layer_model, "--lr", "1", "--max-tokens", "24"]
    runs = run_layout_cases({
        "sp_plain": (1, shared), "sp_shared": (1, shared + ["--shared-prefix"]),
        "sp_pp2_shared": (2, shared + ["--shared-prefix", "--pp", "2"]),
        "moe_ref": (1, moe), "moe_ep2": (2, moe + ["--ep", "2"]),
        "vpp_ref": (1, four), "vpp2": (2, four + ["--pp", "2", "--vpp", "2"]),
    }, str(tmp_path / "layouts"))

    def metrics(case: str) -> dict:
        with open(os.path.join(runs[case], "metrics.json")) as f:
            return json.load(f)

    for case, ref, tol in (("sp_shared", "sp_plain", 1e-6), ("sp_pp2_shared", "sp_plain", 1e-6),
                           ("moe_ep2", "moe_ref", 1e-5), ("vpp2", "vpp_ref", 1e-6)):
        lp_ref, lp = (torch.load(os.path.join(runs[c], "logprobs.pt")) for c in (ref, case))
        assert (lp - lp_ref).abs().max().item() <= tol, case
        before = hf_weights(os.path.join(runs[ref], "export0"))
        want, got = (hf_weights(os.path.join(runs[c], "export1")) for c in (ref, case))
        assert got.keys() == want.keys()
        assert max((want[k] - before[k]).abs().max().item() for k in want) > 1e-3, f"{ref}: the step moved nothing"
        worst = max((got[k] - want[k]).abs().max().item() for k in want)
        assert worst <= tol, f"{case}: weights after the step differ from {ref} by {worst}"
        assert metrics(case)["loss"] == pytest.approx(metrics(ref)["loss"], rel=tol, abs=tol), case
    assert metrics("sp_shared")["tokens_computed"] < metrics("sp_plain")["tokens_computed"]
    assert metrics("sp_shared")["shared_prefix_saved_frac"] > 0
