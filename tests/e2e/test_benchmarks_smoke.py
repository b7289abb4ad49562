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
