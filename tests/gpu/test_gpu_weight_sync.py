"""Weight sync device to device on one GPU: the ipc transport's CUDA path (weight_sync/transports/cuda_ipc.py).

  test                                      what moves                                expected
  ----------------------------------------  ----------------------------------------  ---------------------------
  GPU trainer → local engine on the GPU     flat device buffers, one CUDA IPC handle   every bucket by "cuda";
  (tools/weight_sync/verify.py)             per bucket and dtype, device by UUID        engine logprobs = trainer's
                                                                                       (fp32, 1e-3: matmul order)
  GPU tensors → GPU tensors in a second     the same path, and one handle per tensor   the receiver's bytes equal
  process (tools/weight_sync/bench.py)      (fresh), 24 MB state in 4 MB buckets        the sender's (checksum)

The numbers (ratio to a device-to-device copy) are printed for docs/benchmarks.md (`pytest -s`); they
are never asserted.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_tool


@pytest.mark.gpu(1)
def test_gpu_trainer_syncs_a_gpu_engine_through_cuda_handles(tiny_models) -> None:
    proc = run_tool(["tools/weight_sync/verify.py", "--model-path", tiny_models["llama"], "--transport", "ipc",
                     "--engine-device", "cuda", "--version", "3", "--tol", "1e-3"], timeout=600)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print("GPU trainer → GPU engine (ipc):", json.dumps(result))
    assert result["ipc_paths"] == ["cuda"], result
    assert result["weight_versions"] == ["3"] and result["failed_urls"] == [], result
    assert result["max_abs_logprob_diff"] <= 1e-3, result
    assert result["probe_max_abs_logprob_diff"] <= 1e-3, result


@pytest.mark.gpu(1)
@pytest.mark.parametrize("ipc_mode", ["staged", "fresh"])
def test_gpu_tensors_arrive_exactly_in_another_process(ipc_mode: str) -> None:
    proc = run_tool(["tools/weight_sync/bench.py", "--device", "cuda", "--ipc-mode", ipc_mode, "--size-mb", "24",
                     "--bucket-mb", "4", "--repeats", "3"], timeout=300)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"bench --device cuda --ipc-mode {ipc_mode}:", json.dumps(result))
    assert result["device"] == "cuda" and result["verified"] is True, result
