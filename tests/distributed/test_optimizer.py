"""Megatron's optimizer path on CPU: global-norm gradient clipping and the LR schedule."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import run_tool


@pytest.fixture(scope="module")
def result(tiny_models) -> dict:
    proc = run_tool(["tests/distributed/optim_worker.py", tiny_models["llama"]])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_clipping_scales_the_update_to_the_clip_norm(result) -> None:
    # SGD with lr 1: the update is −clip·g/‖g‖ whenever ‖g‖ > clip, so its norm is exactly the clip.
    assert result["grad_norm"] > 0.01
    assert result["update_norm"] == pytest.approx(0.01, rel=1e-3)


def test_warmup_then_cosine_decay(result) -> None:
    # Megatron's schedule: linear warm-up from 0 over 2 steps, then cosine from 0.1 to 0.01 over the
    # remaining 4 of 6 steps; step k (0-based) trains with the rate for k scheduler steps.
    def expected(k: int) -> float:
        if k <= 2:
            return 0.1 * k / 2
        frac = (k - 2) / (6 - 2)
        return 0.01 + (0.1 - 0.01) * 0.5 * (math.cos(math.pi * frac) + 1)

    assert result["lrs"] == pytest.approx([expected(k) for k in range(6)], abs=1e-9)
