"""The pipeline benchmarks run end to end at a toy size and print their last-line JSON (no numbers checked:
the speedups themselves are measured by hand and recorded in docs/benchmarks.md).

queue_scheduling covers the most: the product in rollout-only mode with redundant prompts and the
dynamic filter (reward from benchmarks/benchlib.py), and the batch-generation baseline over
EngineClient against engine servers the benchmark starts itself.
"""

from __future__ import annotations

import json

from tests.conftest import run_tool


def test_queue_scheduling_smoke(tiny_models, tmp_path) -> None:
    proc = run_tool(["benchmarks/queue_scheduling.py", "--model-path", tiny_models["llama"], "--out", str(tmp_path),
                     "--steps", "2", "--skip", "1", "--engines", "1", "--prompts", "2", "--n", "4",
                     "--extra-prompts", "1", "--max-len", "6", "--max-running", "4", "--no-reference"], timeout=300)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["speedup"] > 0
    for mode in ("queue", "batch"):
        assert result[mode]["time_step"] > 0
        assert 0.0 <= result[mode]["engine_idle_frac"] <= 1.0
    assert result["batch"]["rounds"] >= 1


def test_engine_memory_smoke(tmp_path) -> None:
    """Release frees exactly the model's fp32 bytes of served weights (2 layers, hidden 64: counted by
    hand below), resume brings them back; one kill → one measured restart."""
    proc = run_tool(["benchmarks/engine_memory.py", "--hidden-size", "64", "--num-layers", "2", "--restarts", "1",
                     "--out", str(tmp_path)], timeout=300)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    h, layers, vocab, inter = 64, 2, _vocab(tmp_path / "model"), 128
    kv = h // 4 * 2  # 4 heads, 2 KV heads
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * inter + 2 * h  # q, k+v, o, gate/up/down, two norms
    tied = _tied(tmp_path / "model")
    expected = (vocab * h * (1 if tied else 2) + layers * per_layer + h) * 4 / 2**20
    mem = result["memory"]
    assert abs(mem["serving"]["weights_mb"] - expected) < 1e-6, (mem, expected)
    assert mem["released"]["weights_mb"] == 0
    assert mem["kv resumed"]["weights_mb"] == mem["serving"]["weights_mb"]
    assert len(result["restart_s"]) == 1 and result["restart_s"][0] > 0


def _vocab(model_dir) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def _tied(model_dir) -> bool:
    return bool(json.loads((model_dir / "config.json").read_text()).get("tie_word_embeddings"))


def test_trainer_throughput_moe_smoke() -> None:
    """The MoE run adds the routing-replay mode beside padded / packed / bare Megatron; padding shares
    are plain counts of the batch and checked loosely (packing pads less)."""
    proc = run_tool(["benchmarks/trainer_throughput.py", "--arch", "qwen3_moe", "--hidden-size", "64",
                     "--num-layers", "2", "--batch", "8", "--mean-len", "12", "--max-len", "64",
                     "--rounds", "1", "--steps", "1"], timeout=300)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["arch"] == "qwen3_moe"
    for key in ("tokens_per_s_padded", "tokens_per_s_packed", "tokens_per_s_bare", "tokens_per_s_replay"):
        assert result[key] > 0, key
    assert 0 <= result["padding_frac_packed"] < result["padding_frac_padded"] < 1


def test_cb_step_profile_sees_the_generation_thread(tiny_models) -> None:
    """benchmarks/cb_step_profile.py on the CPU: transformers CB decodes in its own thread, so the torch
    profiler and the stack sampler must both see that thread (ops of the model's forward, CB's step)."""
    proc = run_tool(["benchmarks/cb_step_profile.py", "--model-path", tiny_models["llama"], "--device", "cpu",
                     "--dtype", "float32", "--k", "1,4", "--short", "2", "--long", "10", "--repeats", "1"])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    engine = result["engine"]
    assert set(engine["step_s"]) == {"1", "4"} and all(v > 0 for v in engine["step_s"].values()), engine
    prof = engine["profile"]
    assert prof["k"] == 4 and prof["tokens"] == 10 and prof["seconds_per_step"] > 0, prof
    ops = [name for name, _, _ in prof["top_ops"]]
    assert any(name in ops for name in ("aten::mm", "aten::addmm", "aten::linear")), ops
    functions = [name for name, _ in prof["top_functions"]]
    assert prof["samples"] > 0 and "continuous_api.py:_generation_step" in functions, functions
