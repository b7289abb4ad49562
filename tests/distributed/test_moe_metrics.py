"""The trainer's MoE metrics against an independent count: transformers' own router on the same
samples (real tokens only), one process and expert parallel over two."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_tool


@pytest.mark.parametrize("ep", [1, 2])
def test_expert_load_matches_transformers_routing(tiny_models, ep: int) -> None:
    proc = run_tool(["tests/distributed/moe_metrics_worker.py", tiny_models["qwen3_moe"], str(ep)], nproc=ep)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    trainer = out["trainer"]
    assert trainer["moe_expert_load_max"] == pytest.approx(out["hf_expert_load_max"], abs=1e-5)
    assert 1.0 <= trainer["moe_expert_load_max"] <= 8 / 2  # balanced … every token to the same 2 of 8
    if ep == 1:  # the load-balancing loss is on (checkpoint coefficient) and reported
        assert trainer["moe_aux_loss"] > 0
