"""Who may import whom inside megatron_flash/ (read from the source with ast; nothing is imported).

  package      may import (megatron_flash.*)                        Megatron-Core
  -----------  ---------------------------------------------------  -------------
  config       —                                                    no
  types        —                                                    no
  ports        —                                                    no
  named        — (the "registered name or module:attr" rule)        no
  counters     — (metrics windows)                                  no
  trace        — (the run's timeline and request activity)          no
  versions     — (the tested spans; read by setup.py)               no
  memprobe     — (MF_MEMPROBE: a process's memory profile)           no
  recipes      types (per-step batch shaping and diagnostics)       no
  tracking     config, trace                                        no
  losses       types                                                no
  rewards      config, named, trace, types                          no
  buffer       config, trace, types                                 no
  engines      ports, types                                         no
  hf           config (the LoRA target names)                       yes
  planner      buffer, config (the product's admission rule)        no
  rollout      buffer, config, counters, engines, named, rewards,   no
               trace, types
  agentic      config, counters, engines, named, ports, rewards,    no
               rollout, trace, types
  trainer      config, hf, losses, ports, types, versions           yes
  weight_sync  engines, hf, ports, trace, types                     no
  controller   every package above                                  no

So: nothing imports launch/, tools/ or benchmarks/; only trainer/ and hf/ touch Megatron; rollout/
never imports weight_sync/, trainer/ or agentic/ (group runners plug in through
rollout/group_runner.py); trainer/ and weight_sync/ never import each other (both use hf/); engines/
imports nothing from rollout/. The same table is in README.md ("Architecture").

The table is a strict order (LAYERS, lowest first): a package imports only packages of lower layers,
so no circle can pass between packages. Inside megatron_flash/ no module imports one that imports it
back, directly or through others, even lazily inside a function; imports under `if TYPE_CHECKING:`
are type hints, not dependencies, and are left out of that check, but they too may not point up the
table. Every module stays at or under MAX_LINES lines, the config schema's too (a module per section).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_flash"
ALLOWED: dict[str, set[str]] = {
    "config": set(), "types": set(), "ports": set(), "named": set(), "counters": set(), "planner": {"buffer", "config"},
    "trace": set(), "versions": set(), "memprobe": set(), "recipes": {"types"},
    "tracking": {"config", "trace"}, "losses": {"types"}, "rewards": {"config", "named", "trace", "types"},
    "buffer": {"config", "trace", "types"}, "engines": {"ports", "types"}, "hf": {"config"},
    "rollout": {"buffer", "config", "counters", "engines", "named", "rewards", "trace", "types"},
    "agentic": {"config", "counters", "engines", "named", "ports", "rewards", "rollout", "trace", "types"},
    "trainer": {"config", "hf", "losses", "ports", "types", "versions"},
    "weight_sync": {"engines", "hf", "ports", "trace", "types"},
}
ALLOWED["controller"] = set(ALLOWED)
LAYERS: list[tuple[str, ...]] = [  # lowest first
    ("config", "types", "ports", "named", "counters", "trace", "versions", "memprobe"),
    ("recipes", "tracking", "losses", "rewards", "buffer", "engines", "hf"),
    ("rollout", "trainer", "weight_sync", "planner"),
    ("agentic",),
    ("controller",),
]
MEGATRON_USERS = {"trainer", "hf"}
NEVER = {"launch", "tools", "benchmarks"}
MAX_LINES = 500


def unit_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE).parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def module_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, *, hints: bool) -> list[tuple[int, str, list[str]]]:
    """(line, dotted base module, imported names) of every import, relative ones made absolute;
    only those under `if TYPE_CHECKING:` when `hints`, else only those outside it."""
    tree = ast.parse(path.read_text(), filename=str(path))
    in_hint = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            in_hint.update(id(n) for n in ast.walk(node))
    me = module_of(path) if path.is_relative_to(PACKAGE) else "megatron_flash.probe"
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if (id(node) in in_hint) != hints:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            out.append((node.lineno, base, [a.name for a in node.names]))
    return out


def runtime_imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import outside `if TYPE_CHECKING:` blocks."""
    return [(line, module) for line, module, _ in _imports(path, hints=False)]


def violations(path: Path, unit: str = "", *, hints: bool = False) -> list[str]:
    unit = unit or unit_of(path)
    bad = []
    for line, module, _ in _imports(path, hints=hints):
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
    bad = violations(path) + violations(path, hints=True)
    assert not bad, "\n".join(bad)


def test_the_table_is_a_strict_order() -> None:
    """Each package may import only packages of lower layers: the table itself has no circle."""
    layer = {unit: i for i, units in enumerate(LAYERS) for unit in units}
    assert sorted(layer) == sorted(ALLOWED), "LAYERS and ALLOWED must name the same packages"
    up = [f"{u} → {d}" for u, deps in ALLOWED.items() for d in deps if layer[d] >= layer[u]]
    assert not up, f"allowed imports that do not point down the layers: {up}"


def import_graph(sources: list[Path]) -> dict[str, set[str]]:
    """megatron_flash module → the megatron_flash modules it imports at run time (lazy ones too).
    `from pkg import sub` counts pkg (its __init__) as well as pkg.sub: a package __init__ that imports
    a module which itself does `from pkg import …` is a circle (Python tolerates it only while the
    names read are submodules, and breaks the day one is not)."""
    modules = {module_of(p) for p in sources}

    def resolve(name: str) -> str:
        parts = name.split(".")
        return next((c for c in (".".join(parts[:i]) for i in range(len(parts), 0, -1)) if c in modules), "")

    graph: dict[str, set[str]] = {}
    for path in sources:
        targets = set()
        for _, base, names in _imports(path, hints=False):
            if base.split(".")[0] != "megatron_flash":
                continue
            targets |= {f"{base}.{n}" if f"{base}.{n}" in modules else resolve(base) for n in names or [""]}
            if names and base in modules:  # `from pkg import x` runs (and reads) pkg/__init__ first
                targets.add(base)
        graph[module_of(path)] = targets - {"", module_of(path)}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle as [a, b, ..., a], or [] when there is none (depth-first, three colours)."""
    state: dict[str, int] = {}
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt) and nxt in graph:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return []


def test_no_import_circle() -> None:
    cycle = find_cycle(import_graph(SOURCES))
    assert not cycle, "import circle: " + " → ".join(cycle)


def test_the_cycle_check_finds_a_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    graph = import_graph(SOURCES)  # a submodule imported by name, and a lazy import inside a function
    assert "megatron_flash.controller.assembly" in graph["megatron_flash.controller.loop"]
    assert "megatron_flash.trainer.version_check" in graph["megatron_flash.controller.loop"]
    assert "megatron_flash.controller" not in graph["megatron_flash.controller.loop"]  # no package-init circle


def test_the_cycle_check_counts_a_package_init_circle(tmp_path: Path) -> None:
    """pkg/__init__ imports pkg.a, and pkg.a does `from pkg import b`: a circle through the package's
    __init__, which Python tolerates only while b is a submodule."""
    pkg = tmp_path / "megatron_flash" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from megatron_flash.pkg.a import run\n")
    (pkg / "a.py").write_text("from megatron_flash.pkg import b\n")
    (pkg / "b.py").write_text("X = 1\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path / "megatron_flash"
    try:
        graph = import_graph(sorted(PACKAGE.rglob("*.py")))
    finally:
        PACKAGE = saved
    assert find_cycle(graph) == ["megatron_flash.pkg", "megatron_flash.pkg.a", "megatron_flash.pkg"]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_size(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)}: {lines} lines; split it by concern"


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
