"""model.use_transformer_engine on a machine where Transformer Engine imports and CUDA is present
(both faked here: a stub `transformer_engine` module and torch.cuda.is_available → True): auto takes
the local layer spec when an enabled option needs it and says so in one line; true is refused by name."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron_flash.config import ConfigError, load_config
from megatron_flash.trainer.model_builder import resolve_te, use_te
from megatron_flash.trainer.settings import PolicySettings

REPO = Path(__file__).resolve().parents[2]
BASE = ["model.hf_path=/nonexistent"]


@pytest.fixture
def te_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def settings(overrides: list[str]) -> PolicySettings:
    cfg = load_config(None, BASE + overrides)
    return PolicySettings.from_sections(model=cfg.model, parallel=cfg.parallel, trainer=cfg.trainer,
                                        optimizer=cfg.optimizer)


def test_auto_takes_te_when_nothing_needs_the_local_spec(te_machine: None) -> None:
    assert resolve_te("auto", local_only=settings([]).local_spec_reasons()) == (True, "")
    assert use_te("auto") and not use_te("false")


@pytest.mark.parametrize("overrides, named", [
    (["model.lora.rank=8"], "model.lora.rank=8"),
    (["trainer.shared_prefix=true"], "trainer.shared_prefix=true"),
    (["model.attention_backend=local"], "model.attention_backend=local"),
    (["model.lora.rank=4", "trainer.shared_prefix=true"], "model.lora.rank=4, trainer.shared_prefix=true"),
])
def test_auto_takes_the_local_spec_for_options_that_need_it(te_machine: None, overrides: list[str], named: str) -> None:
    uses_te, note = resolve_te("auto", local_only=settings(overrides).local_spec_reasons())
    assert uses_te is False
    assert "\n" not in note and note.startswith("model.use_transformer_engine=auto")
    assert named in note and "using the local spec" in note


def test_true_with_an_option_that_needs_the_local_spec_is_refused_by_name(te_machine: None) -> None:
    with pytest.raises(ValueError, match=r"model.use_transformer_engine=true with model.lora.rank=8"):
        resolve_te("true", local_only=["model.lora.rank=8"])
    assert resolve_te("true") == (True, "")


def test_without_te_or_cuda_auto_is_local_silently_and_true_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import → ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_te("auto", local_only=["model.lora.rank=8"]) == (False, "")
    with pytest.raises(ValueError, match="transformer_engine does not import"):
        resolve_te("true")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="model.use_transformer_engine=true needs CUDA"):
        resolve_te("true")


@pytest.mark.parametrize("overrides, key", [
    (["model.lora.rank=8"], "model.lora.rank"),
    (["trainer.shared_prefix=true"], "trainer.shared_prefix"),
    (["model.attention_backend=local"], "model.attention_backend=local"),
])
def test_config_refuses_true_with_a_local_only_option(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_config(None, BASE + overrides + ["model.use_transformer_engine=true"])


def test_launcher_refusal_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "pretrain_async_rl.py"), "model.hf_path=" + str(tmp_path),
                           "model.lora.rank=8", "model.use_transformer_engine=true"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "model.lora.rank" in lines[0], proc.stderr
