"""Who may import whom inside megatron_flash/ (read from the source with ast; nothing is imported).

  package      may import (megatron_flash.*)                        Megatron-Core
  -----------  ---------------------------------------------------  -------------
  config       —                                                    no
  types        —                                                    no
  ports        —                                                    no
  named        — (the "registered name or module:attr" rule)        no
  counters     — (metrics windows)                                  no
  planner      —                                                    no
  recipes      types (per-step batch shaping and diagnostics)       no
  tracking     config                                               no
  losses       types                                                no
  rewards      named, types                                         no
  buffer       types                                                no
  engines      ports, types                                         no
  hf           —                                                    yes
  rollout      buffer, config, counters, engines, named, rewards,   no
               types
  agentic      config, counters, engines, named, ports, rewards,    no
               rollout, types
  trainer      config, hf, losses, ports, types                     yes
  weight_sync  engines, hf, ports, types                            no
  controller   every package above                                  no

So: nothing imports launch/, tools/ or benchmarks/; only trainer/ and hf/ touch Megatron; rollout/
never imports weight_sync/, trainer/ or agentic/ (group runners plug in through
rollout/group_runner.py); trainer/ and weight_sync/ never import each other (both use hf/); engines/
imports nothing from rollout/. Imports under `if TYPE_CHECKING:` are type hints, not dependencies,
and are not counted. The same table is in README.md ("Architecture").
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_flash"
ALLOWED: dict[str, set[str]] = {
    "config": set(), "types": set(), "ports": set(), "named": set(), "counters": set(), "planner": set(),
    "recipes": {"types"},
    "tracking": {"config"}, "losses": {"types"}, "rewards": {"named", "types"}, "buffer": {"types"},
    "engines": {"ports", "types"}, "hf": set(),
    "rollout": {"buffer", "config", "counters", "engines", "named", "rewards", "types"},
    "agentic": {"config", "counters", "engines", "named", "ports", "rewards", "rollout", "types"},
    "trainer": {"config", "hf", "losses", "ports", "types"},
    "weight_sync": {"engines", "hf", "ports", "types"},
}
ALLOWED["controller"] = set(ALLOWED)
MEGATRON_USERS = {"trainer", "hf"}
NEVER = {"launch", "tools", "benchmarks"}


def unit_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE).parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def runtime_imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every absolute import outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text(), filename=str(path))
    hints = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            hints.update(id(n) for n in ast.walk(node))
    out = []
    for node in ast.walk(tree):
        if id(node) in hints:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def violations(path: Path, unit: str = "") -> list[str]:
    unit = unit or unit_of(path)
    bad = []
    for line, module in runtime_imports(path):
        parts = module.split(".")
        where = f"{path}:{line} imports {module}"
        if parts[0] in NEVER:
            bad.append(f"{where} (megatron_flash never imports {parts[0]}/)")
        elif parts[0] == "megatron" and unit not in MEGATRON_USERS:
            bad.append(f"{where} (only {sorted(MEGATRON_USERS)} may import Megatron)")
        elif parts[0] == "megatron_flash" and len(parts) > 1 and parts[1] != unit:
            if parts[1] not in ALLOWED.get(unit, set()):
                bad.append(f"{where} ({unit} may import {sorted(ALLOWED.get(unit, set())) or 'nothing'})")
    return bad


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_unit_is_in_the_table() -> None:
    units = {unit_of(p) for p in SOURCES} - {"__init__"}
    assert units <= set(ALLOWED), f"add {sorted(units - set(ALLOWED))} to the layering table"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_follow_the_layering(path: Path) -> None:
    assert not violations(path), "\n".join(violations(path))


def test_the_check_catches_a_crossing(tmp_path: Path) -> None:
    """The checker itself: a rollout module importing the trainer and Megatron is refused twice; a
    type-only import is not counted."""
    probe = tmp_path / "probe.py"
    probe.write_text("from megatron_flash.trainer import policy\nimport megatron.core\n"
                     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from megatron_flash.weight_sync import bridge\n")
    assert [m for _, m in runtime_imports(probe)] == ["megatron_flash.trainer", "megatron.core", "typing"]
    assert len(violations(probe, unit="rollout")) == 2
    assert violations(probe, unit="trainer") == []
