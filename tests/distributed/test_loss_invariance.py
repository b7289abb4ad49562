"""Registry losses through Megatron's per-token contract: the gradient does not depend on the split.

  case          procs  DP  batching                                   micro-batches per rank
  ------------  -----  --  -----------------------------------------  ----------------------
  mb8             1     1  packed, ≤ 8 samples per micro-batch                  1
  padded_mb8      1     1  padded to the longest (pack_sequences=false)         1
  mb1             1     1  packed, 1 sample per micro-batch                     8
  dp2_mb1         2     2  packed, 1 sample                                     4
  budget20        1     1  packed, ≤ 20 tokens per micro-batch              varies (≥ 5)
  dp2_budget20    2     2  packed, ≤ 20 tokens, DP balanced by tokens       varies

One SGD step from the same state on the same off-policy batch (behavior ≠ proximal logprobs, mixed
rewards) must give the same weights (1e-6 abs, step size ~1e-3), for token_mean, seq_mean_token_mean
and (with GSPO's per-sequence ratio) seq_mean_token_sum_norm.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import hf_weights
from tests.distributed.grouped_cases import run_layout_cases

BUDGET = ["--micro-batch-size", "8", "--max-tokens", "20"]
SPLITS = {"mb8": (1, ["--micro-batch-size", "8"]), "padded_mb8": (1, ["--micro-batch-size", "8", "--no-pack"]),
          "mb1": (1, ["--micro-batch-size", "1"]), "dp2_mb1": (2, ["--micro-batch-size", "1"]),
          "budget20": (1, BUDGET), "dp2_budget20": (2, BUDGET)}
LOSSES = {
    "decoupled_ppo-seq_mean_token_mean": ["--loss", "decoupled_ppo", "--aggregation", "seq_mean_token_mean",
                                          "--loss-param", "eps_high=0.28"],
    "topr-token_mean": ["--loss", "topr", "--aggregation", "token_mean", "--loss-param", "level=sequence"],
    # one sequence-level ratio per sample: the packing must keep every sample whole in one micro-batch
    "gspo-seq_mean_token_sum_norm": ["--loss", "gspo", "--aggregation", "seq_mean_token_sum_norm",
                                     "--aggregation-norm", "16", "--loss-param", "eps_low=0.2",
                                     "--loss-param", "eps_high=0.2"],
}
# The newer case runs the splits that differ most (padded vs packed, 1 sample, DP × token budget).
SPLITS_OF = {"gspo-seq_mean_token_sum_norm": ("mb8", "padded_mb8", "mb1", "dp2_budget20")}


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory) -> dict[tuple[str, str], str]:
    """Every (loss, split) run of the module, handed to run_layout_cases together (one launch per
    process count instead of one per run)."""
    cases = {f"{loss}__{split}": (nproc, ["--hf-dir", tiny_models["llama"]] + extra + LOSSES[loss])
             for loss in LOSSES for split, (nproc, extra) in SPLITS.items() if split in SPLITS_OF.get(loss, SPLITS)}
    out = run_layout_cases(cases, str(tmp_path_factory.mktemp("loss_invariance")))
    return {tuple(name.split("__")): path for name, path in out.items()}


@pytest.mark.parametrize("loss", list(LOSSES))
def test_same_step_for_every_split(runs, loss: str) -> None:
    result = {split: (hf_weights(os.path.join(path, "export0")), hf_weights(os.path.join(path, "export1")))
              for (name, split), path in runs.items() if name == loss}
    assert set(result) == set(SPLITS_OF.get(loss, SPLITS))
    before, ref = result["mb8"]
    moved = max((ref[k] - before[k]).abs().max().item() for k in ref)
    assert moved > 1e-4, "the step did not move the weights"
    for split in result:
        got = result[split][1]
        worst = max((got[k] - ref[k]).abs().max().item() for k in ref)
        assert worst <= 1e-6, f"{loss}: {split} differs from mb8 by {worst} (step size {moved})"
