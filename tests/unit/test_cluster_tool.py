"""tools/cluster/cluster.py where it cannot run: one line saying why, exit 3, nothing touched. (The
cluster itself runs in the root-only tier, `make test-cluster`.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

PATH = os.path.join(REPO, "tools", "cluster", "cluster.py")


def _module():
    spec = importlib.util.spec_from_file_location("mf_cluster_tool", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_not_root_is_refused_in_one_line(monkeypatch) -> None:
    cluster = _module()
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    reason = cluster.why_not()
    assert reason is not None and "needs root" in reason and "\n" not in reason


def test_missing_slurm_names_the_install_script(monkeypatch) -> None:
    cluster = _module()
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(cluster.shutil, "which", lambda name: None if name == "slurmd" else f"/usr/bin/{name}")
    reason = cluster.why_not()
    assert reason is not None and "slurmd" in reason and "tools/cluster/install.sh" in reason


@pytest.mark.skipif(os.geteuid() == 0, reason="checks the refusal as a non-root user")
def test_command_line_refusal_exits_3() -> None:
    proc = subprocess.run([sys.executable, PATH, "up", "3"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 3 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_host_addresses_and_config_names() -> None:
    cluster = _module()
    assert cluster.host_names(3) == ["mf-node1", "mf-node2", "mf-node3"]
    assert [cluster.address(h) for h in cluster.host_names(3)] == ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
    # Daemons enter only the network namespace, then their own UTS and mount namespaces: `ip netns
    # exec` would remount /sys and hide the cgroup v1 mounts slurmd needs.
    cmd = cluster.in_host("mf-node2", "slurmd", "-N", "mf-node2")
    assert cmd[:3] == ["nsenter", "--net=/run/netns/mf-node2", "unshare"] and "ip" not in cmd[:3]
