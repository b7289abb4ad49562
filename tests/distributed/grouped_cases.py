"""Run many cases of a worker script with one launch per process count.

A launch costs several seconds of importing torch and Megatron per process (more under torchrun: the
launcher imports torch too, and 4 processes share 2 cores), while one case on the tiny models
computes in about a second. Test modules that compare many layouts therefore hand all their cases
to launch_grouped, which groups them by process count and runs each group in one launch of a worker
that takes `--cases FILE` (a JSON object: case name → that case's arguments) and builds a fresh
policy per case: init_distributed rebuilds Megatron's parallel state and reseeds every RNG, so each
case computes what a launch of its own would (layout_worker's files are bit for bit the same).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

# Generous per-case allowance on a loaded 2-core box (a 4-process MoE case takes ~5 s when quiet).
LAUNCH_TIMEOUT_S, CASE_TIMEOUT_S = 180, 60


def launch_grouped(script: str, cases: dict[str, tuple[int, list[str]]], spec_dir: str) -> str:
    """cases: name → (processes, the script's arguments). Returns the launches' stdout, joined."""
    from tests.conftest import run_tool  # here: the workers import read_cases, and not pytest

    groups: dict[int, dict[str, list[str]]] = defaultdict(dict)
    for name, (nproc, args) in cases.items():
        groups[nproc][name] = args
    stdout = []
    for nproc, group in sorted(groups.items()):
        spec = os.path.join(spec_dir, f"{os.path.basename(script)}_nproc{nproc}.json")
        with open(spec, "w") as f:
            json.dump(group, f)
        stdout.append(run_tool([script, "--cases", spec], nproc=nproc,
                               timeout=LAUNCH_TIMEOUT_S + CASE_TIMEOUT_S * len(group)).stdout)
    return "".join(stdout)


def read_cases(argv: list[str]) -> dict[str, list[str]]:
    """A worker's command line: `--cases FILE` → its cases; anything else is one case's arguments."""
    if argv[:1] == ["--cases"]:
        with open(argv[1]) as f:
            return json.load(f)
    return {"": argv}


def run_layout_cases(cases: dict[str, tuple[int, list[str]]], root: str) -> dict[str, str]:
    """layout_worker.py cases (arguments without --out) → name → the case's output directory."""
    out = {name: os.path.join(root, name) for name in cases}
    for path in out.values():
        os.makedirs(path, exist_ok=True)
    launch_grouped("tests/distributed/layout_worker.py",
                   {name: (nproc, [*args, "--out", out[name]]) for name, (nproc, args) in cases.items()}, root)
    return out
