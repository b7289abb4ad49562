"""The cluster tier (`make test-cluster`): a real Slurm cluster of three hosts on this machine
(tools/cluster), the sbatch templates submitted to it unchanged, the quickstart's warm tiny model.

The cluster comes up once per test module and always goes down (even when a test fails or pytest is
interrupted). Skipped with the reason when this machine cannot run it: not root, no network
namespaces, Slurm not installable; and outside `make test-cluster` (MF_CLUSTER_TESTS=1), so that
`make test` does not spend minutes here.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.cluster.jobs import CLUSTER, MODEL_DIR
from tests.conftest import REPO

HOSTS = 3


def _why_not() -> str | None:
    if os.environ.get("MF_CLUSTER_TESTS") != "1":
        return "the cluster tier runs under `make test-cluster` (MF_CLUSTER_TESTS=1)"
    if os.geteuid() != 0:
        return "the mini-cluster needs root (network namespaces, Slurm's daemons)"
    install = subprocess.run(["bash", os.path.join(REPO, "tools/cluster/install.sh")], capture_output=True,
                             text=True, timeout=600)
    if install.returncode != 0:
        return f"Slurm could not be installed: {install.stderr.strip()[-300:]}"
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"no network namespaces here: {probe.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def cluster():
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    up = subprocess.run([sys.executable, CLUSTER, "up", str(HOSTS)], capture_output=True, text=True, timeout=120)
    try:
        assert up.returncode == 0, f"cluster up failed: {up.stderr}{up.stdout}"
        yield [f"mf-node{i}" for i in range(1, HOSTS + 1)]
    finally:
        down = subprocess.run([sys.executable, CLUSTER, "down"], capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, f"cluster down failed: {down.stderr}"


@pytest.fixture(scope="session")
def warm_model() -> str:
    """The quickstart's tiny model after its format-only warm-up (built once, ~30 s, kept in .cache)."""
    subprocess.run([sys.executable, "tools/cluster/warm_model.py", "--out", MODEL_DIR],
                   cwd=REPO, check=True, capture_output=True, timeout=300,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return os.path.join(MODEL_DIR, "warm_model")
