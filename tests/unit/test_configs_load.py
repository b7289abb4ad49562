"""Every shipped config loads, validates, and holds overrides only (defaults live in the schema)."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any, Dict, Iterator, Tuple

import pytest
from omegaconf import OmegaConf

from megatron_flash.config import RunConfig, flat_keys, load_config

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_FILES = sorted((REPO_ROOT / "configs").glob("*.yaml"))
IDS = [path.name for path in CONFIG_FILES]


def test_configs_exist() -> None:
    assert len(CONFIG_FILES) >= 4, CONFIG_FILES


@pytest.fixture(autouse=True)
def _no_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=IDS)
def test_config_loads_and_validates(path: Path) -> None:
    cfg = load_config(path, [])
    cfg.validate()


def _leaves(node: Dict[str, Any], prefix: str = "") -> Iterator[Tuple[str, Any]]:
    known = set(flat_keys())
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        if dotted in known or not isinstance(value, dict):
            yield dotted, value
        else:
            yield from _leaves(value, f"{dotted}.")


@pytest.mark.parametrize("path", CONFIG_FILES, ids=IDS)
def test_config_holds_overrides_only(path: Path) -> None:
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    assert raw, f"{path.name} sets nothing"
    defaults = RunConfig()
    restated = []
    for key, value in _leaves(raw):
        section, name = key.split(".")
        if getattr(getattr(defaults, section), name) == value:
            restated.append(key)
    assert not restated, f"{path.name} restates defaults: {restated}"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=IDS)
def test_config_starts_with_an_explaining_comment(path: Path) -> None:
    assert path.read_text(encoding="utf-8").startswith("#"), f"{path.name}: say what it is for"


def test_quickstart_settings() -> None:
    cfg = load_config(REPO_ROOT / "configs" / "quickstart_cpu.yaml", [])
    expected = {
        "model.hf_path": "runs/quickstart/warm_model", "parallel.tensor_model_parallel_size": 1,
        "parallel.pipeline_model_parallel_size": 1, "trainer.micro_batch_size": 128,
        "trainer.global_batch_size": 128, "optimizer.lr": 1e-3, "optimizer.name": "adam",
        "loss.name": "tis", "rollout.n_samples_per_prompt": 8, "rollout.max_new_tokens": 8,
        "data.task": "sort4", "engines.backend": "local", "engines.num_engines": 1,
        "async_rl.alpha": 2, "logging.dir": "runs/quickstart/rl", "model.dtype": "float32",
    }
    for key, value in expected.items():
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name) == value, key


def test_loss_swap_composes_with_quickstart() -> None:
    configs = REPO_ROOT / "configs"
    cfg = load_config([configs / "quickstart_cpu.yaml", configs / "loss_tis.yaml"], [])
    base = load_config(configs / "quickstart_cpu.yaml", [])
    assert cfg.loss.name == "tis"
    assert dataclasses.replace(cfg, loss=base.loss) == base  # only the loss changed


def test_api_key_comes_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    path = REPO_ROOT / "configs" / "qwen3_32b_rlvr_gpu.yaml"
    assert load_config(path, []).engines.api_key is None
    monkeypatch.setenv("SGLANG_API_KEY", "from-env")
    assert load_config(path, []).engines.api_key == "from-env"


_HAS_LOSSES = (importlib.util.find_spec("torch") is not None
               and (REPO_ROOT / "megatron_flash" / "losses" / "__init__.py").exists())


@pytest.mark.skipif(not _HAS_LOSSES, reason="needs torch and megatron_flash.losses")
@pytest.mark.parametrize("path", CONFIG_FILES, ids=IDS)
def test_config_loss_builds(path: Path) -> None:
    # loss.params pass verbatim to the loss factory: a misspelled parameter must fail here, not
    # an hour into a GPU job; nor may a loss without behaviour correction meet stale samples.
    from megatron_flash.controller.assembly import check_loss
    from megatron_flash.losses import get_loss

    cfg = load_config(path, [])
    loss = get_loss(cfg.loss.name, **cfg.loss.params, kl_coef=cfg.loss.kl_coef, kl_estimator=cfg.loss.kl_estimator)
    check_loss(cfg, loss)


@pytest.mark.skipif(not _HAS_LOSSES, reason="needs torch and megatron_flash.losses")
def test_schema_choices_match_losses_package() -> None:
    from megatron_flash import losses
    from megatron_flash.config import schema

    assert set(schema.ADVANTAGES) == set(losses.ADVANTAGE_ESTIMATORS)
    assert set(schema.AGGREGATIONS) == set(losses.AGGREGATION_MODES)
    assert set(schema.KL_ESTIMATORS) == set(losses.KL_ESTIMATORS)
    assert set(schema.DISTILL_MODES) == set(losses.DISTILL_MODES)
    assert set(schema.DISTILL_STUDENT_LOGPROBS) == set(losses.STUDENT_LOGPROBS)
