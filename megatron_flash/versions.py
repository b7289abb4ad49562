"""The versions of the packages the project is tested on, and the one warning line for any other.

One table says what is tested; setup.py reads its ranges from here (so the package's requirements
and the launcher's warning cannot disagree), and the launcher calls `untested()` at start-up:

  package         tested span          where it is tested
  --------------  -------------------  --------------------------------------------------------
  megatron-core   >=0.16.1,<0.20       0.16.1: `make test` (the CI lock, the newest release for
                                       Python 3.11); 0.19.2: `make test-compat` (the newest
                                       release, what Python 3.12 users get)
  torch           >=2.11,<2.14         2.13.0 CPU in CI; 2.11 on the GPU test machine
  transformers    >=5.23,<5.24         5.23.0 in CI and the compat tier

A version outside its span is not refused — a cluster's container may carry another megatron-core
that works — but `launch/pretrain_async_rl.py` prints one line naming it and the span, so a crash
after it is read in that light. `make test-compat MCORE_VERSION=X` runs the compat tier against
another release; docs/trainer.md ("Megatron-Core versions") says how to run it against the
megatron-core a container already has.

Pure standard library: setup.py executes this file before anything is installed.
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import Callable, Dict, List, Optional, Tuple

TESTED: Dict[str, str] = {
    "megatron-core": ">=0.16.1,<0.20",
    "torch": ">=2.11,<2.14",
    "transformers": ">=5.23,<5.24",
}

_CLAUSE = re.compile(r"^(>=|<)(\d+(?:\.\d+)*)$")


def release(version: str) -> Tuple[int, ...]:
    """The numeric release of a version string: "2.13.0+cpu" → (2, 13, 0), "0.16.0rc0" → (0, 16, 0).
    ValueError when it does not start with a number."""
    m = re.match(r"^\s*v?(\d+(?:\.\d+)*)", version)
    if not m:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(p) for p in m.group(1).split("."))


def _padded(a: Tuple[int, ...], b: Tuple[int, ...]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    n = max(len(a), len(b))
    return a + (0,) * (n - len(a)), b + (0,) * (n - len(b))


def in_span(version: str, span: str) -> bool:
    """`version` satisfies every ">=X" / "<Y" clause of `span` (comma-separated), by release number.
    ValueError naming a clause of another form."""
    have = release(version)
    for clause in (c.strip() for c in span.split(",") if c.strip()):
        m = _CLAUSE.match(clause)
        if not m:
            raise ValueError(f"span {span!r}: clause {clause!r} is not >=X or <Y")
        a, b = _padded(have, release(m.group(2)))
        if (m.group(1) == ">=" and a < b) or (m.group(1) == "<" and a >= b):
            return False
    return True


def installed(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def untested(version_of: Optional[Callable[[str], Optional[str]]] = None) -> List[str]:
    """One line per installed package of TESTED whose version is outside its span (absent packages
    are left to the import that needs them). `version_of` defaults to `installed`."""
    version_of = version_of or installed
    lines = []
    for package, span in TESTED.items():
        version = version_of(package)
        if version is not None and not in_span(version, span):
            lines.append(f"warning: {package} {version} is untested with megatron-flash (tested: {package}{span}); "
                         f"`make test-compat` checks a version (docs/trainer.md)")
    return lines


def requirement(package: str) -> str:
    """The setup.py requirement of a TESTED package: "megatron-core>=0.16.1,<0.20"."""
    return f"{package}{TESTED[package]}"
