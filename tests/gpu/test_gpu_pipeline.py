"""The product with its trainer on a GPU (1 GPU is enough): CUDA weight sync and the whole quickstart.

The engine is the project's local engine server (SGLang on GPU is not installed on the GPU
machines it ran on), on the CPU or (`--device cuda`) on the same GPU as the trainer; the `ipc` transport stages
the trainer's CUDA tensors into its host shared buffers (one device→host copy) and the engine copies
them into its own weights. Trainer logits are fp32 on the GPU vs fp32 on the engine: compared at 1e-3
(matmul order differs).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_tool


@pytest.mark.gpu(1)
@pytest.mark.parametrize("transport", ["ipc", "disk"])
def test_weight_sync_from_a_gpu_trainer(tiny_models, transport: str) -> None:
    proc = run_tool(["tools/weight_sync/verify.py", "--model-path", tiny_models["llama"], "--transport", transport,
                     "--version", "4", "--tol", "1e-3"], timeout=600)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"weight sync from a GPU trainer ({transport}):", json.dumps(result))
    assert result["weight_versions"] == ["4"], result
    assert result["max_abs_logprob_diff"] <= 1e-3, result
    assert result["probe_max_abs_logprob_diff"] <= 1e-3, result
    assert result["failed_urls"] == [], result


@pytest.mark.gpu(1)
def test_quickstart_learns_with_the_trainer_on_gpu(tmp_path) -> None:
    """The README's quickstart, trainer on CUDA: reward from chance (≈ 1/24) to most prompts solved."""
    proc = run_tool(["launch/quickstart_cpu.py", "--out", str(tmp_path), "logging.wandb_mode=disabled"],
                    timeout=900)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    print("quickstart on GPU:", json.dumps(summary))  # for docs/benchmarks.md (pytest -s)
    assert summary["reward_first5"] < 0.2, summary
    assert summary["reward_last5"] > 0.6, summary
    assert summary["staleness_max"] <= 2, summary


@pytest.mark.gpu(1)
def test_quickstart_learns_with_trainer_and_engine_on_one_gpu(tmp_path) -> None:
    """Both on one GPU: the local engine decodes on CUDA (fp32, so the post-sync probe stays tight)."""
    proc = run_tool(["launch/quickstart_cpu.py", "--out", str(tmp_path), "logging.wandb_mode=disabled",
                     "engines.server_args.device=cuda", "engines.server_args.dtype=float32"], timeout=900)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    print("quickstart, engine on GPU:", json.dumps(summary))  # for docs/benchmarks.md (pytest -s)
    assert summary["reward_first5"] < 0.2, summary
    assert summary["reward_last5"] > 0.6, summary
    assert summary["staleness_max"] <= 2, summary


@pytest.mark.gpu(1)
def test_colocated_quickstart_with_the_trainer_on_gpu(tmp_path) -> None:
    """engines.colocate=true, α = 0, trainer on CUDA: every step the engine releases its memory, the
    push resumes it and sends the new weights as CUDA-IPC handles into the resumed (zeroed) weights;
    the run must still learn and the probe must find the trainer's weights served."""
    proc = run_tool(["launch/quickstart_cpu.py", "--out", str(tmp_path), "logging.wandb_mode=disabled",
                     "engines.colocate=true", "async_rl.alpha=0"], timeout=900)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    print("colocated quickstart on GPU:", json.dumps(summary))
    assert summary["reward_last5"] > 0.6 and summary["staleness_max"] == 0, summary
    rows = [json.loads(x) for x in open(tmp_path / "rl" / "metrics.jsonl") if x.strip()]
    assert rows
    for r in rows:
        assert r["time_release"] > 0 and r["train_infer_logprob_diff"] <= 1e-3, r


@pytest.mark.gpu(1)
@pytest.mark.parametrize("dist_opt", [False, True], ids=["adam", "distributed_adam"])
def test_run_checkpoint_resumes_exactly_on_gpu(tiny_models, tmp_path, dist_opt: bool) -> None:
    """Megatron distributed checkpoint on CUDA (the real synchronous save path, NCCL): save after one
    Adam step, resume in a fresh process, the next step equals the uninterrupted run's."""
    import os

    import torch
    from safetensors.torch import load_file

    flag = ["--distributed-optimizer"] if dist_opt else []
    for mode in ("save", "resume"):
        run_tool(["tests/distributed/ckpt_layout_worker.py", "--hf-dir", tiny_models["llama"], "--mode", mode,
                  "--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / mode), *flag], timeout=600)
    ref, got = (json.load(open(tmp_path / m / "metrics.json")) for m in ("save", "resume"))
    assert abs(ref["loss_b"] - got["loss_b"]) <= 1e-5, (ref, got)

    def weights(d: str) -> dict:
        return {k: v for f in os.listdir(d) if f.endswith(".safetensors") for k, v in load_file(os.path.join(d, f)).items()}

    a, b = weights(str(tmp_path / "save" / "export_after")), weights(str(tmp_path / "resume" / "export_after"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
    assert torch.cuda.is_available()
