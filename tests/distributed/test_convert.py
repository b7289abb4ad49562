"""tools/weight_sync/convert.py: HF → Megatron distributed checkpoint → HF, across layouts.

  family  saved with  loaded with  what it exercises
  ------  ----------  -----------  ----------------------------------------------------------------
  llama   TP2         TP1          TP-sharded QKV / gate_up / vocab merged back; padded vocab 256 kept
  llama   TP2         PP2          layer offsets of the second stage, two safetensors files
  qwen3   PP2         TP2          tied embeddings (no output_layer on disk), q/k norms

The golden values are the source safetensors themselves: every tensor must come back bit-exact (fp32).
"""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_tool

TOOL = "tools/weight_sync/convert.py"


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def _hf_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        out.update(load_file(path))
    return out


def _assert_same_tensors(source: str, converted: str) -> None:
    want, got = _hf_tensors(source), _hf_tensors(converted)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def _convert(args: list[str], *, nproc: int) -> dict:
    result = _last_json(run_tool([TOOL] + args, nproc=nproc).stdout)
    assert result["ok"] is True, result
    return result


@pytest.fixture(scope="module")
def llama_ckpt_tp2(tiny_models, tmp_path_factory) -> str:
    ckpt = str(tmp_path_factory.mktemp("convert") / "llama_tp2")
    result = _convert(["hf-to-mcore", "--hf", tiny_models["llama"], "--out", ckpt, "--tp", "2"], nproc=2)
    assert result["padded_vocab_size"] == 256  # 128 × TP2: the loader must keep it
    assert not os.path.exists(ckpt + ".partial")
    assert os.path.isfile(os.path.join(ckpt, "metadata.json")) and os.path.isfile(os.path.join(ckpt, "hf_config", "config.json"))
    return ckpt


@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2)], ids=["tp1", "pp2"])
def test_llama_tp2_checkpoint_exports_bit_exact(tiny_models, llama_ckpt_tp2, tmp_path, tp: int, pp: int) -> None:
    out = str(tmp_path / "hf")
    _convert(["mcore-to-hf", "--ckpt", llama_ckpt_tp2, "--out", out, "--tp", str(tp), "--pp", str(pp)], nproc=tp * pp)
    _assert_same_tensors(tiny_models["llama"], out)
    assert json.load(open(os.path.join(out, "config.json")))["architectures"] == ["LlamaForCausalLM"]


def test_qwen3_tied_pp2_to_tp2(tiny_models, tmp_path) -> None:
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    _convert(["hf-to-mcore", "--hf", tiny_models["qwen3"], "--out", ckpt, "--pp", "2"], nproc=2)
    _convert(["mcore-to-hf", "--ckpt", ckpt, "--out", out, "--tp", "2", "--hf-config", tiny_models["qwen3"]], nproc=2)
    _assert_same_tensors(tiny_models["qwen3"], out)


def test_moe_ep2_checkpoint_exports_bit_exact_at_other_layouts(tiny_models, tmp_path) -> None:
    """Experts saved from two expert-parallel ranks load at EP1 and at TP2 × EP2 (with SP)."""
    ckpt = str(tmp_path / "ckpt")
    assert _convert(["hf-to-mcore", "--hf", tiny_models["qwen3_moe"], "--out", ckpt, "--ep", "2"], nproc=2)["ep"] == 2
    for tp, ep in ((1, 1), (2, 2)):
        out = str(tmp_path / f"hf_tp{tp}_ep{ep}")
        _convert(["mcore-to-hf", "--ckpt", ckpt, "--out", out, "--tp", str(tp), "--ep", str(ep)], nproc=tp * ep)
        _assert_same_tensors(tiny_models["qwen3_moe"], out)


@pytest.mark.parametrize("args,message", [
    (["mcore-to-hf", "--ckpt", "{tmp}/no_such_ckpt", "--out", "{tmp}/out"], "checkpoint directory '{tmp}/no_such_ckpt' does not exist"),
    (["mcore-to-hf", "--ckpt", "{tmp}", "--out", "{tmp}/out"], "is not a Megatron distributed checkpoint (no metadata.json)"),
    (["hf-to-mcore", "--hf", "{tmp}/no_such_model", "--out", "{tmp}/out"], "HF directory '{tmp}/no_such_model' does not exist"),
    (["hf-to-mcore", "--hf", "{tmp}", "--out", "{tmp}/out"], "has no config.json"),
], ids=["missing-ckpt", "not-a-ckpt", "missing-hf", "hf-without-config"])
def test_bad_paths_fail_clearly_and_write_nothing(tmp_path, args: list[str], message: str) -> None:
    tmp = str(tmp_path)
    proc = run_tool([TOOL] + [a.format(tmp=tmp) for a in args], check=False, timeout=120)
    assert proc.returncode == 2
    assert message.format(tmp=tmp) in proc.stderr
    assert _last_json(proc.stdout)["ok"] is False
    assert not os.path.exists(os.path.join(tmp, "out")) and not os.path.exists(os.path.join(tmp, "out.partial"))
