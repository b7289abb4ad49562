"""The SGLang contract tier (tests/contract) against the local engine on a GPU: `--device cuda --dtype
float32`, every module that does not need real SGLang (those skip themselves). Run as its own pytest so
that its session fixtures (engines, tiny models) are its own; its summary line is printed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.gpu(1)
def test_contract_tier_against_the_local_engine_on_cuda() -> None:
    env = {**os.environ, "MF_CONTRACT_BACKENDS": "cuda", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/contract"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    print("contract tier on cuda:", proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "<no output>")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
