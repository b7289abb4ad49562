"""benchmarks/env_async.py end to end at a toy size (one local engine server, a few short episodes): its
last-line JSON has every key, and every mode completed the same work. No speedup is checked here: the
numbers are measured by hand and recorded in docs/benchmarks.md."""

from __future__ import annotations

import json

from tests.conftest import run_tool


def test_env_async_smoke(tiny_models) -> None:
    proc = run_tool(["benchmarks/env_async.py", "--model-path", tiny_models["llama"], "--mu-ms", "5",
                     "--headline-mu-ms", "5", "--groups", "3", "--concurrent-groups", "2", "--group-size", "2",
                     "--turns", "2", "--tokens-per-turn", "2", "--redundancy", "1", "--redundancy-mu-ms", "5",
                     "--redundancy-turns", "2", "--slow-fraction", "0.5", "--slow-factor", "3"], timeout=120)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("speedup", "speedup_pool", "speedup_redundancy"):
        assert result[key] > 0, key
    row = result["by_mu"]["5"]
    work = {mode: (row[mode]["episodes"], row[mode]["turns"], row[mode]["model_tokens"])
            for mode in ("batch", "async", "pool")}
    assert work["batch"] == work["async"] == work["pool"] == (6, 12, 24)  # 3 groups × 2 episodes × 2 turns × 2 tokens
    for mode in ("batch", "async", "pool"):
        assert row[mode]["seconds"] > 0 and 0.0 <= row[mode]["idle_fraction"] <= 1.0
    tail = result["redundancy"]
    assert tail["r0"]["episodes"] == tail["r1"]["episodes"] == 6
    assert tail["r0"]["model_tokens"] == tail["r1"]["model_tokens"] == 24
