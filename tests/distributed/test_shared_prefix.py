"""Shared-prefix packing gives the unshared layout's numbers, under every layout (gloo, CPU, fp32).

The batch (layout_worker.grouped_batch): 8 samples in 3 groups — prompts of 6, 3 and 8 tokens with
responses of 4/9/2/7, 5 (a group of one) and 3/6/1 tokens. Under a 24-token budget the first group
(6 + 22 = 28 tokens shared) is split into sub-groups that each carry the prompt, so one group spans
micro-batches. Each case runs twice, shared (trainer.shared_prefix) and unshared, from the same
checkpoint, and takes TWO optimizer steps on the batch (a peer matched at step 1 and diverged at step 2):

  case          procs  layout         loss                            batching
  ------------  -----  -------------  ------------------------------  ---------------------------
  tp1             1    TP1            fixed weighted NLL              packed ≤ 24 tokens (split group)
  tp1_all         1    TP1            fixed weighted NLL              one micro-batch (no budget)
  tp2sp           2    TP2 + SP       tis                             ≤ 24 tokens
  pp2             2    PP2            fixed weighted NLL              ≤ 24 tokens
  vpp2            2    PP2 × VPP2     tis (4-layer model)             ≤ 24 tokens
  dp2             2    DP2            decoupled_ppo                   ≤ 24 tokens, DP-balanced units
  <loss>          1    TP1            every registered loss           ≤ 24 tokens
  <aggregation>   1    TP1            tis with every aggregation      ≤ 24 tokens
  topk            1    TP1            tis + distillation's top-4 KL   ≤ 24 tokens (extras carry K ids)
  recast          1    TP1            fixed weighted NLL              ≤ 24 tokens, every row's cu_seqlens a
                                                                      cast copy: RoPE positions and plans
                                                                      are passed explicitly, not on it

Compared: logprobs before the step (1e-6), both steps' losses (1e-6), the weights after the two steps
(SGD lr 1, no clipping: the sum of both steps' gradients), ≤ 1e-6; and the shared run computes fewer
tokens.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import hf_weights
from tests.distributed.grouped_cases import run_layout_cases

LOSSES = ("cispo", "decoupled_ppo", "gspo", "ppo", "reinforce", "tis", "topr")  # = losses.list_losses()
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
BASE = ["--grouped", "--steps", "2", "--lr", "1", "--micro-batch-size", "8"]
BUDGET = ["--max-tokens", "24"]
CASES = {
    "tp1": ("two", 1, BUDGET),
    "tp1_all": ("two", 1, []),
    "tp2sp": ("two", 2, BUDGET + ["--tp", "2", "--sp", "--loss", "tis"]),
    "pp2": ("two", 2, BUDGET + ["--pp", "2"]),
    "vpp2": ("four", 2, BUDGET + ["--pp", "2", "--vpp", "2", "--loss", "tis"]),
    # SGD: Adam's first steps are ±lr per weight whatever the gradient's size, so 1e-7 of float noise on a
    # near-zero gradient moves a weight by up to 2·lr, and weights stop telling gradients apart
    "dp2": ("two", 2, BUDGET + ["--loss", "decoupled_ppo"]),
    "topk": ("two", 1, BUDGET + ["--loss", "tis", "--distill-topk", "4", "--distill-coef", "0.5"]),
    "recast": ("two", 1, BUDGET + ["--recast-cu-seqlens"]),
}
for _loss in LOSSES:
    CASES[f"loss_{_loss}"] = ("two", 1, BUDGET + ["--loss", _loss])
for _agg in AGGREGATIONS:
    CASES[f"agg_{_agg}"] = ("two", 1, BUDGET + ["--loss", "tis", "--aggregation", _agg]
                            + (["--aggregation-norm", "16"] if _agg.endswith("_norm") else []))


@pytest.fixture(scope="module")
def runs(tiny_models, four_layer_model, tmp_path_factory) -> dict[tuple[str, bool], str]:
    models = {"two": tiny_models["llama"], "four": four_layer_model}
    cases = {}
    for case, (model, nproc, extra) in CASES.items():
        for shared in (False, True):
            cases[f"{case}__{'shared' if shared else 'plain'}"] = (
                nproc, ["--hf-dir", models[model], *BASE, *extra] + (["--shared-prefix"] if shared else []))
    out = run_layout_cases(cases, str(tmp_path_factory.mktemp("shared_prefix")))
    return {(name.split("__")[0], name.endswith("shared")): path for name, path in out.items()}


def metrics(path: str) -> dict:
    with open(os.path.join(path, "metrics.json")) as f:
        return json.load(f)


def test_losses_match_the_registry() -> None:
    from megatron_flash.losses import list_losses

    assert sorted(LOSSES) == list_losses()


@pytest.mark.parametrize("case", list(CASES))
def test_shared_prefix_equals_unshared_over_two_steps(runs, case: str) -> None:
    plain, shared = runs[(case, False)], runs[(case, True)]
    lp_plain, lp_shared = (torch.load(os.path.join(p, "logprobs.pt")) for p in (plain, shared))
    assert (lp_plain - lp_shared).abs().max().item() <= 1e-6
    m_plain, m_shared = metrics(plain), metrics(shared)
    assert len(m_plain["losses"]) == len(m_shared["losses"]) == 2
    for a, b in zip(m_plain["losses"], m_shared["losses"]):
        assert abs(a - b) <= 1e-6, (m_plain["losses"], m_shared["losses"])
    before = hf_weights(os.path.join(plain, "export0"))
    want, got = hf_weights(os.path.join(plain, "export1")), hf_weights(os.path.join(shared, "export1"))
    assert max((want[k] - before[k]).abs().max().item() for k in want) > 1e-3, "the steps did not move the weights"
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= 1e-6, f"{case}: weights after two steps differ by {worst}"
    assert m_shared["tokens_computed"] < m_plain["tokens_computed"]


def test_prompts_are_computed_once(runs) -> None:
    """One micro-batch, no budget: the row holds each prompt once (6 + 22, 3 + 5, 8 + 10 tokens)
    against every sample whole (10 + 15 + 8 + 13, 8, 11 + 14 + 9 = 88 tokens)."""
    assert metrics(runs[("tp1_all", False)])["tokens_computed"] == 88
    assert metrics(runs[("tp1_all", True)])["tokens_computed"] == 28 + 8 + 18
    # saved: the prompts of 6 and 8 tokens computed once instead of 4 and 3 times
    assert metrics(runs[("tp1_all", True)])["shared_prefix_saved_frac"] == pytest.approx((6 * 3 + 8 * 2) / 88)
    assert "shared_prefix_saved_frac" not in metrics(runs[("tp1_all", False)])
