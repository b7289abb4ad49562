"""A loss without behaviour correction (its ratio against π_prox, or none) is refused where samples are
off-policy (async_rl.alpha > 0, trainer.mode=train_only) unless loss.allow_uncorrected; the opt-in is
refused where it lifts nothing; every run's first line says what each ratio is taken against.

The flags are the registry's (register_loss(on_policy=..., describe=...)), never a list of names here
that the code also holds: the expectations below come from each formula (docs/losses.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_flash.config import ConfigError, load_config
from megatron_flash.controller.assembly import check_loss
from megatron_flash.losses import LossTerms, get_loss, register_loss
from megatron_flash.losses import registry
from megatron_flash.losses.registry import corrected_losses
from megatron_flash.trainer.loss_adapter import build_loss

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart_cpu.yaml")
# From the formulas: ppo's ratio is π_θ/π_prox, reinforce has none; the others weigh by π_·/μ.
UNCORRECTED = ("ppo", "reinforce")
CORRECTED = ("decoupled_ppo", "tis", "cispo", "topr")


def checked(*overrides: str) -> str:
    cfg = load_config(QUICKSTART, list(overrides))
    return check_loss(cfg, build_loss(cfg.loss))


def test_builtin_flags_follow_the_formulas() -> None:
    assert all(get_loss(name).on_policy for name in UNCORRECTED)
    assert not any(get_loss(name).on_policy for name in CORRECTED)
    assert set(CORRECTED) <= set(corrected_losses()) and not set(UNCORRECTED) & set(corrected_losses())


@pytest.mark.parametrize("name, says", [
    ("ppo", ["π_θ/π_prox", "[1−0.2, 1+0.28]", "behaviour correction: none"]),
    ("decoupled_ppo", ["π_θ/π_prox", "behaviour correction: yes", "π_prox/μ", "weight > 3.0 dropped"]),
    ("tis", ["ρ = π_θ/μ", "clamp(ρ, 0.0, 1.0)", "behaviour correction: yes"]),
    ("cispo", ["ρ = π_θ/μ", "clamp(ρ, 1−1.0, 1+0.28)", "behaviour correction: yes"]),
    ("topr", ["ρ = π_θ/μ per token", "reward > 0", "behaviour correction: yes on responses with reward ≤ 0"]),
    ("reinforce", ["no ratio", "behaviour correction: none"]),
])
def test_each_description_names_the_ratio_its_parameters_and_the_correction(name: str, says: list[str]) -> None:
    params = {"ppo": {"eps_high": 0.28}, "decoupled_ppo": {"weight_cap": 3.0}, "cispo": {"eps_high": 0.28}}
    text = get_loss(name, **params.get(name, {})).description
    for part in says:
        assert part in text, (part, text)


def test_common_corrections_join_the_description() -> None:
    text = get_loss("tis", mismatch_mask="sequence", mismatch_low=0.9, mismatch_high=1.1, kl_coef=0.05,
                    kl_estimator="k1").description
    assert "mismatch masking: sequences (geometric mean) whose π_prox/μ is outside [0.9, 1.1] dropped" in text
    assert "KL(π_θ‖π_ref) penalty × 0.05 (k1)" in text
    assert "mismatch" not in get_loss("tis").description and "KL" not in get_loss("tis").description


def test_a_user_loss_declares_both_and_an_option_can_flip_the_flag() -> None:
    name = "test_optionally_corrected"
    try:
        @register_loss(name, on_policy=lambda p: not p["corrected"],
                       describe="weight {corrected}; behaviour correction: as the option says")
        def optional(*, corrected: bool = False):
            return lambda batch: LossTerms(-batch.advantages * batch.logprobs, {})

        assert get_loss(name).on_policy and not get_loss(name, corrected=True).on_policy
        assert get_loss(name, corrected=True).description.startswith("weight True;")
        assert name not in corrected_losses()  # uncorrected with its defaults
        cfg = load_config(QUICKSTART, [f"loss.name={name}"])
        with pytest.raises(ValueError, match=f"loss.name={name} has no behaviour correction"):
            check_loss(cfg, build_loss(cfg.loss))
        cfg = load_config(QUICKSTART, [f"loss.name={name}", "loss.params.corrected=true"])
        assert "loss test_optionally_corrected: weight True" in check_loss(cfg, build_loss(cfg.loss))
    finally:
        registry._REGISTRY.pop(name, None)
    undeclared = "test_undeclared"
    try:
        register_loss(undeclared)(lambda: (lambda batch: LossTerms(-batch.advantages * batch.logprobs, {})))
        assert not get_loss(undeclared).on_policy  # the default: a user loss is trusted to correct
        assert "no description registered" in get_loss(undeclared).description
        register_loss("test_bad_template", describe="weight {nope}")(
            lambda: (lambda batch: LossTerms(-batch.advantages * batch.logprobs, {})))
        with pytest.raises(ValueError, match="describe template 'weight {nope}' names 'nope'"):
            get_loss("test_bad_template")
    finally:
        registry._REGISTRY.pop(undeclared, None)
        registry._REGISTRY.pop("test_bad_template", None)


@pytest.mark.parametrize("name", UNCORRECTED)
def test_an_uncorrected_loss_on_stale_samples_is_refused_naming_the_fix(name: str) -> None:
    with pytest.raises(ValueError) as info:
        checked(f"loss.name={name}")  # the quickstart runs at alpha = 2
    message = str(info.value)
    assert f"loss.name={name} has no behaviour correction" in message
    assert "async_rl.alpha=2 trains samples up to 2 policy versions old" in message
    assert "loss.allow_uncorrected=true" in message
    fixes = message.split("(loss.name=")[-1].split(")")[0].split("|")
    assert set(CORRECTED) <= set(fixes) and not set(UNCORRECTED) & set(fixes)
    assert "\n" not in message


def test_a_replay_is_off_policy_at_any_alpha() -> None:
    with pytest.raises(ValueError, match="trainer.mode=train_only trains samples replayed from another run"):
        checked("loss.name=ppo", "async_rl.alpha=0", "trainer.mode=train_only", "trainer.replay_path=g.jsonl")


def test_what_is_accepted_and_the_first_line_of_the_run() -> None:
    line = checked()  # the quickstart: tis at alpha 2
    assert line.startswith("loss tis: ratio ρ = π_θ/μ") and "behaviour correction: yes" in line
    assert line.endswith("off-policy data: async_rl.alpha=2 trains samples up to 2 policy versions old")
    line = checked("loss.name=ppo", "async_rl.alpha=0")
    assert "behaviour correction: none" in line and line.endswith("on-policy data (async_rl.alpha=0)")
    line = checked("loss.name=ppo", "loss.allow_uncorrected=true")
    assert line.endswith("loss.allow_uncorrected=true: stale samples train uncorrected")
    checked("loss.name=ppo", "trainer.mode=rollout_only")  # trains nothing: nothing to refuse


def test_the_opt_in_is_refused_where_it_lifts_nothing() -> None:
    with pytest.raises(ValueError, match="loss.allow_uncorrected=true is only used with a loss that has no "
                                         "behaviour correction; loss.name=tis has one"):
        checked("loss.allow_uncorrected=true")
    with pytest.raises(ConfigError, match="loss.allow_uncorrected=true is only used when training samples can be "
                                          "off-policy .*got async_rl.alpha=0, trainer.mode=full"):
        load_config(QUICKSTART, ["loss.name=ppo", "loss.allow_uncorrected=true", "async_rl.alpha=0"])


def test_the_default_config_is_not_refused() -> None:
    cfg = load_config(None, ["model.hf_path=/unused"])
    assert cfg.async_rl.alpha > 0  # so the default loss must correct for the behaviour policy
    assert "behaviour correction: yes" in check_loss(cfg, build_loss(cfg.loss))


def test_the_launcher_refuses_before_starting_in_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK")}
    proc = subprocess.run([sys.executable, "launch/pretrain_async_rl.py", "--config", "configs/quickstart_cpu.yaml",
                           "loss.name=ppo"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "loss.name=ppo has no behaviour correction" in lines[0], proc.stderr[-2000:]
