"""tools/weight_sync/bench.py at a small size: every transport delivers the exact bytes and reports sane numbers.

  transport  mode    what it exercises
  ---------  ------  -----------------------------------------------------------------------
  ipc        staged  the transport's SharedBuffers + Stager → the engine's SharedBufferMaps, 2 buffers
                     alternating, tensors larger than a buffer in pieces
  ipc        fresh   the ipc transport's pickled path (ForkingPickler), local engine's allowlist unpickler
  broadcast  bucket  2-rank gloo group from process_group.new_weight_update_group, one flat broadcast per
                     bucket received by the engine's receive_broadcast (the bridge's way)
  broadcast  tensor  the same group, one broadcast per tensor
  disk       —       safetensors files per bucket

The receiver's checksum (integer sums of the raw words of every tensor, per name) must equal the
sender's, and each repeat changes the values, so a receiver that keeps stale bytes fails.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tests.conftest import REPO, run_tool

TOOL = "tools/weight_sync/bench.py"


def _bench():
    spec = importlib.util.spec_from_file_location("mf_bench", os.path.join(REPO, TOOL))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("extra", [["--transport", "ipc"], ["--transport", "ipc", "--ipc-mode", "fresh"],
                                   ["--transport", "broadcast"], ["--transport", "broadcast", "--broadcast-mode",
                                                                  "tensor"], ["--transport", "disk"]],
                         ids=["ipc-staged", "ipc-fresh", "broadcast", "broadcast-tensor", "disk"])
def test_bench_delivers_exact_bytes(extra: list[str]) -> None:
    proc = run_tool([TOOL, "--size-mb", "8", "--bucket-mb", "1", "--repeats", "2"] + extra, timeout=180)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["verified"] is True and len(r["checksum"]) == 16
    assert 4 <= r["size_mb"] <= 16 and r["num_tensors"] > 5
    assert r["gbps"] > 0 and r["memcpy_gbps"] > 0 and 0 < r["ratio_to_memcpy"] < 10
    assert abs(r["gbps"] - r["size_mb"] * 2**20 / r["seconds"] / 1e9) < 0.05 * r["gbps"]  # seconds are rounded to 0.1 ms
    assert r["peak_extra_mb"] is not None and r["receiver_peak_extra_mb"] is not None
    if r["ipc_mode"] == "staged":
        assert r["num_buffers"] == 2 and r["buffer_mb"] == 1  # the bucket: the 4 MB tensors went in pieces


def test_bench_on_a_model_directory(tiny_models) -> None:
    proc = run_tool([TOOL, "--model-path", tiny_models["llama"], "--bucket-mb", "0.05", "--repeats", "2"], timeout=180)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["verified"] is True and r["num_tensors"] == 21 and 0.2 < r["size_mb"] < 0.5


def test_llama_shapes_hit_the_requested_size() -> None:
    bench = _bench()
    for size_mb in (8, 64, 1024):
        total = sum(4 * __import__("math").prod(s) for _, s in bench.llama_shapes(size_mb)) / 2**20
        assert 0.75 * size_mb <= total <= 1.25 * size_mb, (size_mb, total)


def test_stream_memory_mode_reports_the_bounds(tiny_models) -> None:
    proc = run_tool([TOOL, "--mode", "stream-memory", "--model-path", tiny_models["llama"], "--bucket-mb", "0.05",
                     "--repeats", "1"], timeout=180)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0.3 < r["model_mb"] < 0.4 and r["largest_bucket_mb"] >= 0.05 and r["hf_buckets_seconds"] > 0
    assert r["bucket_plus_layer_mb"] > r["bucket_mb"] and r["peak_extra_mb"] is not None
