"""trainer/patches/: the one home of what megatron-flash changes inside megatron-core and torch. Outside
it no module of megatron_flash assigns to an attribute of a megatron or torch module or class (read
from the source: `mod.attr = ...` / setattr on a name bound to an import of megatron, torch or
transformer_engine, or to importlib.import_module(...); and any `x.__class__ = ...`). Every patch
module says what it replaces, why, for which versions and how it is checked, and
megatron_compat.check() runs each one's check."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_flash"
PATCHES = PACKAGE / "trainer" / "patches"
ROOTS = ("megatron", "torch", "transformer_engine")


def assignments(source: str) -> list[str]:
    """`target` text of every assignment to a megatron/torch module's or class's attribute in `source`."""
    tree = ast.parse(source)
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in ROOTS}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ROOTS:
            bound |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):  # m = importlib.import_module(..)
            func = node.value.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "import_module":
                bound |= {t.id for t in node.targets if isinstance(t, ast.Name)}

    def root(expr: ast.expr) -> str:
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        return expr.id if isinstance(expr, ast.Name) else ""

    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                if isinstance(t, ast.Attribute) and (t.attr == "__class__" or root(t) in bound):
                    found.append(ast.unparse(t))
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("setattr", "delattr") and node.args \
                and root(node.args[0]) in bound:
            found.append(ast.unparse(node.args[0]) + "." + ast.unparse(node.args[1]))
    return found


def test_the_check_finds_each_kind_of_assignment() -> None:
    source = """
import torch
import importlib
from megatron.core.models.common.embeddings import rope_utils
from megatron.core import parallel_state as ps
torch.Tensor.type = None
rope_utils.f = None
m = importlib.import_module("megatron.core.utils")
m.torch = None
setattr(ps, "x", 1)
obj.__class__ = int
local.attr = 1  # an object of our own: fine
"""
    assert assignments(source) == ["torch.Tensor.type", "rope_utils.f", "m.torch", "obj.__class__", "ps.'x'"]


@pytest.mark.parametrize("path", sorted(p for p in PACKAGE.rglob("*.py") if PATCHES not in p.parents),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_patch_outside_the_patches_package(path: Path) -> None:
    found = assignments(path.read_text())
    assert not found, f"{path.relative_to(PACKAGE)} changes Megatron or torch ({found}): move it to trainer/patches/"


def test_every_patch_is_documented_registered_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_flash.trainer import megatron_compat, patches

    modules = {p.stem for p in PATCHES.glob("*.py")} - {"__init__", "base"}
    assert {m.__name__.rsplit(".", 1)[1] for m in patches.PATCHES} == modules
    for module in patches.PATCHES:
        doc = module.__doc__ or ""
        for word in ("replaces", "why", "versions", "checked"):
            assert f"\n  {word}" in doc, f"{module.__name__}: its docstring has no '{word}' line"
        assert module.__name__.rsplit(".", 1)[1] in patches.__doc__  # and the package's table names it
    checked = []
    for module in patches.PATCHES:
        monkeypatch.setattr(module, "check", lambda name=module.__name__: checked.append(name))
    megatron_compat.check(cpu=True)
    assert checked == [m.__name__ for m in patches.PATCHES]
    checked.clear()
    megatron_compat.check(cpu=False)
    assert checked == [m.__name__ for m in patches.PATCHES if m not in patches.CPU_ONLY]
