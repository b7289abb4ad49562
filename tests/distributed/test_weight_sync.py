"""Weight sync trainer → CPU engine server for each transport and layout (tools/weight_sync/verify.py).

  layout    procs  transports                what it exercises
  --------  -----  ------------------------  -------------------------------------------------
  TP1 PP1     1    ipc, broadcast, disk      buckets (50 KB: several per sync), protocol
  TP2         2    ipc                       TP all-gather of QKV / gate_up / vocab before send
  TP2 PP2     4    ipc, disk                 two PP senders, layer offsets, tied/untied handling

After two SGD steps (lr 0.5: the weights move far from the checkpoint) and a sync, the engine samples
and its behavior logprobs must equal the trainer's logprobs of the same tokens (≤ 1e-4, fp32), and it
must report the new weight_version.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_tool

CASES = [(1, 1, "ipc"), (1, 1, "broadcast"), (1, 1, "disk"), (2, 1, "ipc"), (2, 2, "ipc"), (2, 2, "disk")]


@pytest.mark.parametrize("tp,pp,transport", CASES, ids=[f"tp{t}pp{p}-{x}" for t, p, x in CASES])
def test_engine_serves_the_trainer_weights_after_sync(tiny_models, tp: int, pp: int, transport: str) -> None:
    proc = run_tool(["tools/weight_sync/verify.py", "--model-path", tiny_models["llama"], "--tp", str(tp),
                     "--pp", str(pp), "--transport", transport, "--version", "3"], nproc=tp * pp)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["weight_version"] == "3"
    assert result["max_abs_logprob_diff"] <= 1e-4, result
    if transport != "disk":
        assert result["num_buckets"] >= 2 and result["bytes_sent"] > 0


def test_the_comparison_is_not_vacuous(tiny_models) -> None:
    """Control: with tolerance 0 the check reports a nonzero float difference, i.e. it compares numbers."""
    proc = run_tool(["tools/weight_sync/verify.py", "--model-path", tiny_models["llama"], "--transport", "disk",
                     "--tol", "0"], check=False)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["max_abs_logprob_diff"] > 0  # the tolerance-0 run shows the comparison is not vacuous


def test_broadcast_with_a_multi_rank_trainer_refuses_clearly(tiny_models) -> None:
    proc = run_tool(["tools/weight_sync/verify.py", "--model-path", tiny_models["llama"], "--pp", "2",
                     "--transport", "broadcast"], nproc=2, check=False)
    assert proc.returncode != 0
    assert "supports a single-process trainer only" in proc.stderr
