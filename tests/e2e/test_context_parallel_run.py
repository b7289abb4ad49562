"""Context parallelism end to end (launch/pretrain_async_rl.py under torchrun, gloo, local engine).

- A rollout-only dump of 10 steps replayed by train-only runs at CP1 (one process) and CP2 (two): the
  same loss at every step (≤ 1e-6) and grad norm, π_prox recomputed under CP2 too, while each CP2 rank
  computes about half of the tokens.
- An asynchronous CP2 run (α = 1): every sample's behaviour logprob μ from the engine equals the CP2
  trainer's logprob of the version that sampled it (the weight push reads CP rank 0; the trainer's
  logprobs are gathered over both ranks), staleness ≤ α, every step trained.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import run_tool
from tests.e2e.test_async_pipeline import small_run


def run(args: list[str], *, nproc: int = 1, timeout: int = 600):
    from tests.conftest import REPO

    return run_tool(args, env={"PYTHONPATH": REPO}, timeout=timeout, nproc=nproc)


def metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_a_replay_gives_the_same_losses_at_cp1_and_cp2(tiny_models, tmp_path) -> None:
    dump = str(tmp_path / "groups.jsonl")
    run(small_run(tiny_models["llama"], str(tmp_path / "ro"), "trainer.mode=rollout_only",
                  f"rollout.dump_path={dump}", "trainer.total_steps=10"))
    runs = {}
    for cp in (1, 2):
        runs[cp] = str(tmp_path / f"cp{cp}")
        run(small_run(tiny_models["llama"], runs[cp], "trainer.mode=train_only", f"trainer.replay_path={dump}",
                      "trainer.total_steps=10", f"parallel.context_parallel_size={cp}"), nproc=cp)
    one, two = metrics(runs[1]), metrics(runs[2])
    assert [r["version"] for r in one] == [r["version"] for r in two] == list(range(1, 11))
    for a, b in zip(one, two):
        assert abs(a["train/loss"] - b["train/loss"]) <= 1e-6, (a["train/loss"], b["train/loss"])
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5, abs=1e-7)
        # each CP2 rank: half of the rows, each sequence padded to a multiple of 4 (≤ 3 tokens per sample)
        assert a["train/tokens_computed"] / 2 <= b["train/tokens_computed"] <= (a["train/tokens_computed"] + 3 * 16) / 2
    assert any(r["train/loss"] != 0 for r in one)


def test_an_async_cp2_run_trains_on_the_engine_weights(tiny_models, tmp_path) -> None:
    run_dir = str(tmp_path / "async")
    run(small_run(tiny_models["llama"], run_dir, "parallel.context_parallel_size=2", "async_rl.alpha=1",
                  "trainer.total_steps=6"), nproc=2)
    rows = metrics(run_dir)
    assert len(rows) == 6 and sum(r["train/update_ok"] for r in rows) >= 3, rows  # (a step whose groups all tie skips)
    assert max(r["staleness_max"] for r in rows) <= 1
    labelled = [r for r in rows if r.get("mismatch_labelled_tokens")]
    assert labelled, "no step compared μ with the trainer's logprobs of the labelled version"
    assert max(r["mismatch_labelled_max"] for r in labelled) <= 1e-4, [r["mismatch_labelled_max"] for r in labelled]
