"""megatron_flash/versions.py: the tested spans, the warning line for a version outside them, and
setup.py's requirements read from the same table."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pytest

from megatron_flash import versions

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version,span,expected", [
    ("0.16.1", ">=0.16.1,<0.20", True),
    ("0.16.0", ">=0.16.1,<0.20", False),
    ("0.16.0rc0.dev132713", ">=0.16.1,<0.20", False),
    ("0.19.2", ">=0.16.1,<0.20", True),
    ("0.20.0", ">=0.16.1,<0.20", False),
    ("0.20", ">=0.16.1,<0.20", False),
    ("2.13.0+cpu", ">=2.11,<2.14", True),
    ("2.11.0+cu130", ">=2.11,<2.14", True),
    ("2.14.1", ">=2.11,<2.14", False),
    ("2.10.0", ">=2.11,<2.14", False),
    ("5.23.0", ">=5.23,<5.24", True),
    ("5.24.0", ">=5.23,<5.24", False),
])
def test_in_span_compares_release_numbers(version: str, span: str, expected: bool) -> None:
    assert versions.in_span(version, span) is expected


def test_a_span_of_another_form_is_refused_by_clause() -> None:
    with pytest.raises(ValueError, match="'~=0.16'"):
        versions.in_span("0.16.1", "~=0.16")
    with pytest.raises(ValueError, match="not a version"):
        versions.release("dev")


def test_untested_names_the_version_and_the_span_once_per_package() -> None:
    have = {"megatron-core": "0.21.0", "torch": "2.13.0+cpu", "transformers": None}
    lines = versions.untested(have.get)
    assert len(lines) == 1
    assert "megatron-core 0.21.0" in lines[0] and "megatron-core>=0.16.1,<0.20" in lines[0]
    assert "\n" not in lines[0]
    assert versions.untested({"megatron-core": "0.19.2", "torch": "2.11.0", "transformers": "5.23.0"}.get) == []


def test_the_ci_lock_is_inside_every_span() -> None:
    lock = dict(line.strip().split("==") for line in (REPO / "requirements/cpu-lock.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    for package, span in versions.TESTED.items():
        assert versions.in_span(lock[package], span), (package, lock[package], span)


def test_setup_py_requires_exactly_the_tested_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    import setuptools

    seen: dict[str, Any] = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: seen.update(kwargs))
    runpy.run_path(str(REPO / "setup.py"), run_name="__main__")
    requires = seen["install_requires"]
    for package, span in versions.TESTED.items():
        assert f"{package}{span}" in requires
    names = [r.split(">")[0].split("<")[0].split("=")[0] for r in requires]
    assert len(names) == len(set(names))  # each package named once


def test_the_launcher_warns_once_about_an_untested_megatron_and_goes_on(monkeypatch, capsys, tmp_path) -> None:
    import importlib.util

    from megatron_flash.config import load_config

    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda p: "0.21.0" if p == "megatron-core" else real(p))
    spec = importlib.util.spec_from_file_location("launcher_under_test", REPO / "launch/pretrain_async_rl.py")
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    cfg = load_config([str(REPO / "configs/quickstart_cpu.yaml")], [f"model.hf_path={tmp_path}/missing"])
    assert launcher.run(cfg) == launcher.EXIT_CONFIG_ERROR  # it went on to the next check (the path)
    err = capsys.readouterr().err.splitlines()
    warnings = [line for line in err if line.startswith("warning: megatron-core 0.21.0")]
    assert len(warnings) == 1 and "megatron-core>=0.16.1,<0.20" in warnings[0]
    assert any("model.hf_path" in line and "no such directory" in line for line in err)
