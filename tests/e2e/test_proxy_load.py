"""1,000 concurrent requests through the proxy against two local engines: all complete exactly once,
the per-engine in-flight bound holds (benchmarks/proxy_load.py asserts completeness itself; the
timing and memory figures it prints are recorded in docs/benchmarks.md, not asserted here)."""

from __future__ import annotations

import json

from tests.conftest import run_tool


def test_thousand_concurrent_requests_complete_with_bounded_inflight() -> None:
    proc = run_tool(["benchmarks/proxy_load.py", "--requests", "1000", "--engines", "2", "--inflight", "32"],
                    timeout=600)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["completed"] == 1000
    assert all(1 <= m <= 32 for m in out["max_inflight_seen"])
