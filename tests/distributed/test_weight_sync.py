"""Weight sync trainer → local engine servers for each transport and layout (tools/weight_sync/verify.py).

  layout    procs  engines  transports             what it exercises
  --------  -----  -------  ---------------------  ------------------------------------------------
  TP1 PP1     1       1     ipc, broadcast, disk   buckets (50 KB: several per sync), protocol
  TP2         2       1     ipc, broadcast, disk   TP all-gather of QKV / gate_up / vocab before send
  PP2         2       1     ipc, broadcast, disk   two senders; broadcast: one update group per stage
  TP2 PP2     4       1     ipc, broadcast, disk   both of the above, layer offsets, tied/untied
  TP2 PP2     4       2     broadcast              each stage's group holds both engines; stages take
                                                   turns (engines serve one update at a time)
  MoE EP2     2       1     ipc, broadcast, disk   Qwen3-MoE: each EP rank sends its own 4 experts
                                                   (broadcast: gathered to the stage's sender)
  MoE TP2 EP2 4       1     ipc                    + each expert all-gathered over expert-TP (with SP)

After two SGD steps (lr 0.5: the weights move far from the checkpoint) and a sync, every engine
samples and its behavior logprobs must equal the trainer's logprobs of the same tokens (≤ 1e-4,
fp32), it must report the new weight_version, and the bridge's own post-sync probe (teacher-forced
input logprobs) must agree too.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_tool

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
CASES = [(tp, pp, transport, 1) for tp, pp in LAYOUTS for transport in ("ipc", "broadcast", "disk")]
CASES.append((2, 2, "broadcast", 2))


@pytest.mark.parametrize("tp,pp,transport,num_engines", CASES,
                         ids=[f"tp{t}pp{p}-{x}" + (f"-{n}engines" if n > 1 else "") for t, p, x, n in CASES])
def test_engine_serves_the_trainer_weights_after_sync(tiny_models, tp: int, pp: int, transport: str,
                                                      num_engines: int) -> None:
    proc = run_tool(["tools/weight_sync/verify.py", "--model-path", tiny_models["llama"], "--tp", str(tp),
                     "--pp", str(pp), "--transport", transport, "--version", "3",
                     "--num-engines", str(num_engines)], nproc=tp * pp)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["weight_versions"] == ["3"]
    assert result["max_abs_logprob_diff"] <= 1e-4, result
    assert result["probe_max_abs_logprob_diff"] <= 1e-4, result
    assert len(result["synced_urls"]) == num_engines and result["failed_urls"] == []
    if transport != "disk":
        assert result["num_buckets"] >= 2 and result["bytes_sent"] > 0


MOE_CASES = [(["--ep", "2"], 2, t) for t in ("ipc", "broadcast", "disk")] + [(["--tp", "2", "--sp", "--ep", "2"], 4, "ipc")]


@pytest.mark.parametrize("layout,nproc,transport", MOE_CASES, ids=["ep2-ipc", "ep2-broadcast", "ep2-disk", "tp2sp-ep2-ipc"])
def test_moe_experts_reach_the_engine(tiny_models, layout: list[str], nproc: int, transport: str) -> None:
    proc = run_tool(["tools/weight_sync/verify.py", "--model-path", tiny_models["qwen3_moe"], *layout,
                     "--transport", transport, "--version", "2"], nproc=nproc)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ep"] == 2 and result["weight_versions"] == ["2"]
    assert result["max_abs_logprob_diff"] <= 1e-4 and result["probe_max_abs_logprob_diff"] <= 1e-4, result
    if transport != "disk":  # 2 layers × 8 experts × 3 tensors + router, attention, norms, embedding
        assert result["bytes_sent"] > 0 and result["num_buckets"] >= 2


def test_the_comparison_is_not_vacuous(tiny_models) -> None:
    """Control: with tolerance 0 the check reports a nonzero float difference, i.e. it compares numbers."""
    proc = run_tool(["tools/weight_sync/verify.py", "--model-path", tiny_models["llama"], "--transport", "disk",
                     "--tol", "0"], check=False)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["max_abs_logprob_diff"] > 0  # the tolerance-0 run shows the comparison is not vacuous
