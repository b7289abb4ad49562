"""The cluster tier (`make test-cluster`): a real Slurm cluster of three hosts on this machine
(tools/cluster), the sbatch templates submitted to it unchanged, the quickstart's warm tiny model.

The cluster comes up once per session and always goes down (even when a test fails or pytest is
interrupted); each module starts on an idle cluster (no job left, every host idle), and one that a
previous module left otherwise is brought down and up again. Skipped with the reason when this
machine cannot run it: not root, no network namespaces, Slurm not installable; and outside
`make test-cluster` (MF_CLUSTER_TESTS=1), so that `make test` does not spend minutes here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.cluster.jobs import CLUSTER, WARM_MODEL
from tests.conftest import REPO

HOSTS = 5


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


def _cluster(command: str) -> None:
    args = [command, str(HOSTS)] if command == "up" else [command]
    proc = subprocess.run([sys.executable, CLUSTER, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"cluster {command} failed: {proc.stderr}{proc.stdout}"


def _idle() -> tuple[str | None, bool]:
    """(None when no job is queued or running and every host is idle, else what is not; whether waiting
    can help: a job still ending, or hosts still busy with it)."""
    from tests.cluster.jobs import slurm

    try:
        jobs = slurm("squeue", "-h", "-o", "%i %T").strip()
        nodes = slurm("sinfo", "-h", "-N", "-o", "%N %T").strip().splitlines()
    except (AssertionError, subprocess.SubprocessError) as error:
        return str(error), False
    states = [line.split()[-1] for line in nodes]
    if not jobs and len(states) == HOSTS and all(s == "idle" for s in states):
        return None, False
    passing = len(states) == HOSTS and all(s in ("idle", "mixed", "allocated", "completing") for s in states)
    return f"squeue: {jobs or '-'}; sinfo: {'; '.join(nodes)}", passing


@pytest.fixture(scope="session")
def _session_cluster():
    """One cluster for the whole tier: bringing it up and down (6-15 s) once instead of per module."""
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    try:
        _cluster("up")
        yield [f"mf-node{i}" for i in range(1, HOSTS + 1)]
    finally:
        _cluster("down")


@pytest.fixture(scope="module")
def cluster(_session_cluster):
    """The session's cluster, idle, as a fresh one would be: a module must not inherit a previous one's
    job, or a host it left drained or down (then the cluster is made again)."""
    deadline = time.monotonic() + 30  # a cancelled job's steps take a few seconds to be cleaned up
    why, passing = _idle()
    while why is not None and passing and time.monotonic() < deadline:
        time.sleep(1)
        why, passing = _idle()
    if why is not None:  # a job that does not end, a host drained, down or not responding
        print(f"cluster not idle after the previous module ({why}): down and up again")
        _cluster("down")
        _cluster("up")
        assert _idle()[0] is None, _idle()
    return _session_cluster


@pytest.fixture(scope="session")
def warm_model() -> str:
    """The quickstart's tiny model after its format-only warm-up: benchlib's cached one (built once, ~30 s,
    kept under runs/bench_models; the soak of `make test` uses it too)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from benchlib import quickstart_warm_model

    path = quickstart_warm_model(seed=0, name="cluster")
    assert path == WARM_MODEL, (path, WARM_MODEL)
    return path
