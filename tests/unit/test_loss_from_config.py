"""The configured loss comes from the registry: YAML or `key=value` changes it, nothing branches on names."""

from __future__ import annotations

import os
import re

import pytest
import torch

from megatron_flash.config import load_config
from megatron_flash.trainer.loss_adapter import build_loss, build_loss_fn
from megatron_flash.types import TrainBatch
from tests.conftest import REPO


def test_override_changes_the_loss() -> None:
    cfg = load_config(os.path.join(REPO, "configs/quickstart_cpu.yaml"), ["loss.name=cispo", "loss.params.eps_high=0.3"])
    loss = build_loss(cfg.loss)
    assert loss.name == "cispo" and loss.params["eps_high"] == 0.3


def test_yaml_changes_the_loss() -> None:
    cfg = load_config([os.path.join(REPO, "configs/quickstart_cpu.yaml"), os.path.join(REPO, "configs/loss_tis.yaml")], [])
    assert build_loss(cfg.loss).name == "tis"


def test_bad_loss_param_is_named() -> None:
    cfg = load_config(None, ["loss.name=ppo", "loss.params.weight_cap=2.0"])
    with pytest.raises(ValueError, match="loss 'ppo' got unknown parameter 'weight_cap'"):
        build_loss(cfg.loss)


def test_loss_fn_follows_the_per_token_contract() -> None:
    """token_mean: loss_sum is Σ per-token loss over trained tokens, denominator their count."""
    cfg = load_config(None, ["loss.name=reinforce"])
    _, loss_fn = build_loss_fn(cfg.loss)
    lp = torch.tensor([[0.0, -1.0, -2.0, 0.0]], requires_grad=True)
    mb = TrainBatch(tokens=torch.zeros(1, 4, dtype=torch.long), loss_mask=torch.tensor([[0.0, 1.0, 1.0, 0.0]]),
                    behavior_logprobs=torch.zeros(1, 4), advantages=torch.tensor([[0.0, 2.0, 2.0, 0.0]]),
                    rewards=torch.tensor([1.0]))
    loss_sum, denom, _ = loss_fn(mb, lp, None)
    assert loss_sum.item() == pytest.approx(-(2.0 * -1.0 + 2.0 * -2.0))  # −A·logπ summed
    assert int(denom) == 2


LOSS_NAMES = ("ppo", "decoupled_ppo", "tis", "cispo", "topr", "reinforce")
BRANCH = re.compile(r"""(==|!=|\bin\b)\s*[\(\[\{]?\s*["'](%s)["']""" % "|".join(LOSS_NAMES))


def test_nothing_outside_losses_branches_on_a_loss_name() -> None:
    offenders = []
    for root, _, files in os.walk(os.path.join(REPO, "megatron_flash")):
        if os.sep + "losses" in root:
            continue
        for f in files:
            if f.endswith(".py"):
                text = open(os.path.join(root, f)).read()
                offenders += [f"{f}: {m.group(0)}" for m in BRANCH.finditer(text)]
    assert offenders == []


def test_launcher_rejects_a_bad_loss_param_before_starting() -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "launch/pretrain_async_rl.py", "--config", "configs/quickstart_cpu.yaml",
                           "loss.name=tis", "loss.params.uper=2.0"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "loss 'tis' got unknown parameter 'uper'" in proc.stderr
