"""GPU versions of the foundation checks (NCCL, bf16). Each test is marked with the GPUs it needs and
is skipped only when the machine has fewer (see tests/conftest.py).

Tolerances are bf16's: logits carry ~3 significant digits, so layouts are compared at 5e-2 on
logprobs (fp32 on CPU is held to 1e-5 in tests/distributed).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import run_tool


@pytest.mark.gpu(1)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-3), ("bfloat16", 5e-2)])
def test_parity_one_gpu(tiny_models, family: str, dtype: str, tol: float) -> None:
    proc = run_tool(["tools/check_parity.py", "--hf-dir", tiny_models[family], "--dtype", dtype, "--tol", str(tol)])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["max_abs_logprob_diff"] <= tol, result


@pytest.mark.gpu(2)
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_parity_two_gpus(tiny_models, tp: int, pp: int) -> None:
    proc = run_tool(["tools/check_parity.py", "--hf-dir", tiny_models["qwen3"], "--tp", str(tp), "--pp", str(pp),
                     "--dtype", "bfloat16", "--tol", "5e-2"], nproc=2)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["max_abs_logprob_diff"] <= 5e-2, result


@pytest.mark.gpu(4)
def test_layouts_agree_after_one_step_nccl(tiny_models, tmp_path) -> None:
    """TP2×PP2 vs TP1 on NCCL in fp32: logprobs and one SGD step (same check as the gloo tier)."""
    from safetensors.torch import load_file

    out = {}
    for name, (tp, pp, n) in {"ref": (1, 1, 1), "tp2pp2": (2, 2, 4)}.items():
        out[name] = str(tmp_path / name)
        run_tool(["tests/distributed/layout_worker.py", "--hf-dir", tiny_models["llama"], "--out", out[name],
                  "--tp", str(tp), "--pp", str(pp)], nproc=n)
    ref = torch.load(os.path.join(out["ref"], "logprobs.pt"))
    got = torch.load(os.path.join(out["tp2pp2"], "logprobs.pt"))
    assert (ref - got).abs().max().item() <= 1e-4
    a = load_file(os.path.join(out["ref"], "export1", "model-00001-of-00001.safetensors"))
    b = {}
    for f in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        b.update(load_file(os.path.join(out["tp2pp2"], "export1", f)))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-4
