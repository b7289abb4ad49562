"""LoRA through the product (launch/pretrain_async_rl.py, a local engine): the version-label check
covers adapters, in both sync modes.

  run        α  weight_sync.lora  pause    what is checked
  ---------  -  ----------------  -------  ---------------------------------------------------------------
  adapter    2  adapter (ipc)     retract  every trained token's μ = the trainer's logprob under the adapter
                                           of its labelled version (≤ 1e-5, fp32); pushes move only the
                                           adapters (bytes = their size); HF export: merged + PEFT adapter
  merged     0  merged (disk)     abort    the same labels; on-policy, so the trainer's logprobs equal the
                                           engine's μ at numerical noise (train/mismatch_abs ≤ 1e-5); the run
                                           starts from a PEFT adapter (model.lora.adapter_path), so version
                                           0 is not the base: the engines must get it before they serve

The trainer keeps its adapters of the last α + 1 versions (trainer.version_check_interval=1) and scores
each trained token under its label; requests name the adapter of the version they start on, and the
engine (which merges one adapter at a time) labels tokens by the version that sampled them.
"""

from __future__ import annotations

import json
import os

from safetensors.torch import load_file

from tests.e2e.test_async_pipeline import metrics, run, small_run

# The engine runs merged weights W + s·BA (formed in fp32); the trainer computes W·x + s·B·(A·x): two
# roundings of one function. The largest gap over a run's tokens was ≤ 1.7e-6 on the dev box and 1.69e-5
# once on the CI box (merged mode, 2026-12-01): sample-dependent rounding, not a label error.
TOLERANCE = 5e-5
ADAPTER_BYTES = 6656 * 4  # rank 4 on every target of the tiny Llama: 6,656 float32 parameters


def lora_run(model: str, run_dir: str, *extra: str) -> None:
    run(small_run(model, run_dir, "trainer.total_steps=6", "trainer.version_check_interval=1",
                  "rollout.max_new_tokens=16", "model.lora.rank=4", "optimizer.lr=1e-2",
                  # one group generating at a time: pushes land while samples are generating
                  "engines.server_args={max_running_requests: 4}", "loss.name=tis", *extra), timeout=600)


def check_labels(rows: list[dict]) -> None:
    checked = trained = 0
    print("labelled max per step", [r["mismatch_labelled_max"] for r in rows])
    for r in rows:
        assert r["mismatch_labelled_max"] <= TOLERANCE, r
        checked += r["mismatch_labelled_tokens"]
        trained += r["train/num_trained_tokens"]
    assert trained > 0 and checked == trained


def test_adapter_pushes_keep_labels_exact(tiny_models, tmp_path) -> None:
    run_dir = str(tmp_path / "run")
    lora_run(tiny_models["llama"], run_dir, "async_rl.alpha=2", "rollout.pause_mode=retract",
             "weight_sync.transport=ipc", "checkpoint.save_hf_at_end=true")
    rows = metrics(run_dir)
    assert len(rows) == 6
    check_labels(rows)
    assert max(r["staleness_token_max"] for r in rows) >= 1  # stale tokens were checked, not only fresh ones
    # the first step's optimizer state: Adam's two moments and step per adapter parameter, nothing of the base
    assert 2 * ADAPTER_BYTES <= rows[0]["train/optimizer_state_gb"] * 1e9 <= 2 * ADAPTER_BYTES + 4096
    assert all(r["train_infer_logprob_diff_max"] <= TOLERANCE for r in rows)
    final = os.path.join(run_dir, "final_hf")
    with open(os.path.join(final, "adapter", "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 32.0, "LORA")
    adapter = load_file(os.path.join(final, "adapter", "adapter_model.safetensors"))
    assert len(adapter) == 2 * 7 * 2  # layers × HF modules × (A, B)
    # a push carries the PEFT tensors (A once per HF module: q, k, v share one), nothing else
    assert all(r["sync_gb"] * 1e9 == sum(t.numel() * t.element_size() for t in adapter.values()) for r in rows)
    assert sum(t.numel() for t in adapter.values()) < 2 * ADAPTER_BYTES / 4


def start_adapter(model: str, path: str) -> None:
    """A PEFT adapter (rank 4, alpha 32, every target) with B ≠ 0, of this model's shapes."""
    import torch
    from safetensors import safe_open

    from megatron_flash.hf.adapters import peft_config, write_peft_adapter

    gen, tensors = torch.Generator().manual_seed(5), {}
    with safe_open(os.path.join(model, "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            module = name.removesuffix(".weight")
            if module.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
                out_f, in_f = f.get_slice(name).get_shape()
                tensors[f"{module}.lora_B.weight"] = torch.randn(out_f, 4, generator=gen) * 0.05
                tensors[f"{module}.lora_A.weight"] = torch.randn(4, in_f, generator=gen) * 0.1
    for fused in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):  # one A per fused Megatron linear
        for name in [n for n in tensors if f".{fused[0]}.lora_A" in n]:
            for other in fused[1:]:
                tensors[name.replace(fused[0], other)] = tensors[name]
    write_peft_adapter(path, tensors, peft_config(rank=4, alpha=32, dropout=0.0, targets=("qkv", "proj", "fc1", "fc2"),
                                                  base_model=model))


def test_merged_pushes_are_on_policy_at_alpha_0(tiny_models, tmp_path) -> None:
    run_dir = str(tmp_path / "run")
    start_adapter(tiny_models["llama"], str(tmp_path / "start_adapter"))
    lora_run(tiny_models["llama"], run_dir, "async_rl.alpha=0", "weight_sync.lora=merged",
             "weight_sync.transport=disk", "rollout.pause_mode=abort",
             f"model.lora.adapter_path={tmp_path / 'start_adapter'}")
    rows = metrics(run_dir)
    assert len(rows) == 6
    check_labels(rows)
    assert max(r["staleness_token_max"] for r in rows) == 0
    assert all(r["train/mismatch_abs"] <= TOLERANCE for r in rows), [r["train/mismatch_abs"] for r in rows]
    assert any(r["train/grad_norm"] > 0 for r in rows)  # the adapters trained: the pushes carried new weights
