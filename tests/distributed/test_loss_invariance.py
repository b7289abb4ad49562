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
and (with GSPO's per-sequence ratio) seq_mean_token_sum_norm; and with on-policy distillation's
teacher top-k reverse KL as a loss term (its K student logprobs per token laid into the packed row and
back). That term's value in the step's metrics must also equal the KL computed here from a plain
transformers forward of the checkpoint (float64), for packed and padded micro-batches.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

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
    # on-policy distillation: tis plus coef · the teacher top-4 reverse KL (losses/distill.py)
    "tis-topk4-token_mean": ["--loss", "tis", "--aggregation", "token_mean", "--distill-topk", "4",
                             "--distill-coef", "0.5"],
}
# The newer case runs the splits that differ most (padded vs packed, 1 sample, DP × token budget).
SPLITS_OF = {"gspo-seq_mean_token_sum_norm": ("mb8", "padded_mb8", "mb1", "dp2_budget20"),
             "tis-topk4-token_mean": ("mb8", "padded_mb8", "mb1", "dp2_budget20")}


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


def test_topk_reverse_kl_term_equals_a_transformers_forward(runs, tiny_models) -> None:
    """The KL the trainer's loss took (metric distill/topk_reverse_kl, from the forward before the
    step) against the same KL from HF logits, float64, written out per token (not losses/distill.py)."""
    from transformers import AutoModelForCausalLM

    from tests.distributed.layout_worker import fixed_batch, teacher_topk

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float64).eval()
    batch = fixed_batch(model.config.vocab_size)
    teacher = teacher_topk(batch, model.config.vocab_size, 4)
    with torch.no_grad():
        logits = model(batch.tokens).logits
    log_p = torch.log_softmax(logits[:, :-1], dim=-1)  # row t predicts token t + 1
    total, count = 0.0, 0
    for i in range(batch.tokens.shape[0]):
        for t in range(1, batch.tokens.shape[1]):
            if batch.loss_mask[i, t] == 0:
                continue
            ids, t_lp = teacher["teacher_topk_ids"][i, t], teacher["teacher_topk_logprobs"][i, t].double()
            s_lp = log_p[i, t - 1, ids]
            p, q = s_lp.exp(), t_lp.exp()
            kl = float((p * (s_lp - t_lp)).sum())
            p_rest, q_rest = 1 - float(p.sum()), 1 - float(q.sum())
            kl += p_rest * (torch.log(torch.tensor(p_rest)) - torch.log(torch.tensor(q_rest))).item()
            total, count = total + kl, count + 1
    want = total / count
    for split in ("mb8", "padded_mb8", "mb1"):
        metrics = json.load(open(os.path.join(runs[("tis-topk4-token_mean", split)], "metrics.json")))
        assert abs(metrics["distill/topk_reverse_kl"] - want) <= 1e-5, (split, metrics, want)
