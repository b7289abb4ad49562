"""Paths under /tmp where every host has its own /tmp: refused in one line that names the path and the
fix, by tools/cluster/cluster.py up, by the Slurm templates on the mini-cluster (or wherever
MF_TMP_IS_NODE_LOCAL=1), and by the trainer for its own keys; a multi-node trainer refuses a
checkpoint folder under /tmp anywhere."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_flash.config import load_config
from tests.conftest import REPO

CLUSTER = os.path.join(REPO, "tools", "cluster", "cluster.py")
LAUNCHER = os.path.join(REPO, "launch", "pretrain_async_rl.py")


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cluster_tool_names_the_first_path_under_tmp() -> None:
    cluster = _load(CLUSTER, "mf_cluster_tool_tmp")
    assert cluster.tmp_refusal({}, checkout="/work/repo") is None
    line = cluster.tmp_refusal({}, checkout="/tmp/clone")
    assert line is not None and "the checkout /tmp/clone" in line and "outside /tmp" in line and "\n" not in line
    line = cluster.tmp_refusal({"MODEL_PATH": "/tmp/m", "LOG_DIR": "/work/logs"}, checkout="/work/repo")
    assert line is not None and "MODEL_PATH /tmp/m" in line
    assert cluster.tmp_refusal({"LOG_DIR": "/tmpfoo/logs"}, checkout="/work/repo") is None  # a prefix, not /tmp


def test_cluster_up_from_a_checkout_under_tmp_exits_2_and_touches_nothing(tmp_path: Path) -> None:
    assert str(tmp_path.resolve()).startswith("/tmp/"), "pytest's tmp_path is expected under /tmp here"
    copy = tmp_path / "clone" / "tools" / "cluster" / "cluster.py"
    copy.parent.mkdir(parents=True)
    shutil.copy(CLUSTER, copy)
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout \
        if shutil.which("ip") else ""
    proc = subprocess.run([sys.executable, str(copy), "up", "3"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(tmp_path / "clone") in lines[0] and "outside /tmp" in lines[0]
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout if shutil.which("ip") else ""
    assert after == before


def _shared_paths(env: dict[str, str], *pairs: str) -> subprocess.CompletedProcess:
    script = 'source launch/slurm/common.sh; mf_shared_paths "$@"; echo "MF_TMP_IS_NODE_LOCAL=${MF_TMP_IS_NODE_LOCAL:-}"'
    return subprocess.run(["bash", "-c", script, "check", *pairs], cwd=REPO, capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], **env}, timeout=30)


def test_templates_refuse_tmp_paths_on_the_mini_cluster() -> None:
    proc = _shared_paths({"SLURM_CLUSTER_NAME": "mfcluster"}, "checkout=/work/x", "MODEL_PATH=/tmp/model",
                         "LOG_DIR=/work/logs")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: MODEL_PATH=/tmp/model is under /tmp, which is each host's own on this "
                                   "cluster: put it on the shared filesystem (outside /tmp)")
    ok = _shared_paths({"SLURM_CLUSTER_NAME": "mfcluster"}, "checkout=/work/x", "MODEL_PATH=/work/model", "VENV=")
    assert ok.returncode == 0 and "MF_TMP_IS_NODE_LOCAL=1" in ok.stdout, ok.stderr  # the trainer checks its keys


def test_templates_leave_tmp_alone_elsewhere_unless_told() -> None:
    assert _shared_paths({"SLURM_CLUSTER_NAME": "prod"}, "MODEL_PATH=/tmp/model").returncode == 0
    told = _shared_paths({"MF_TMP_IS_NODE_LOCAL": "1"}, "LOG_DIR=/tmp/logs/../logs2")
    assert told.returncode == 2 and "LOG_DIR=/tmp/logs/../logs2" in told.stderr


def test_render_of_a_template_refuses_model_path_under_tmp() -> None:
    proc = subprocess.run([sys.executable, os.path.join(REPO, "launch", "slurm", "render.py"),
                           os.path.join(REPO, "launch", "slurm", "multi_node_disaggregated.sbatch"),
                           "--nodelist", "n[1-3]", "--env", "MODEL_PATH=/tmp/m", "--env", "MF_TMP_IS_NODE_LOCAL=1",
                           "--env", "TRAIN_NODES=1", "--env", "CONFIG=configs/quickstart_cpu.yaml"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "MODEL_PATH=/tmp/m is under /tmp" in proc.stderr, proc.stderr + proc.stdout


@pytest.mark.parametrize("env, overrides, key", [
    ({"MF_TMP_IS_NODE_LOCAL": "1"}, ["checkpoint.save_dir=/tmp/ck"], "checkpoint.save_dir"),
    ({"MF_TMP_IS_NODE_LOCAL": "1"}, ["logging.dir=/tmp/run"], "logging.dir"),
    ({"MF_TMP_IS_NODE_LOCAL": "1"}, ["model.hf_path=/tmp/model"], "model.hf_path"),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, ["checkpoint.save_dir=/tmp/ck"], "checkpoint.save_dir"),
])
def test_trainer_refuses_its_keys_under_node_local_tmp(env: dict, overrides: list[str], key: str) -> None:
    launcher = _load(LAUNCHER, "mf_launcher_tmp")
    cfg = load_config(None, ["model.hf_path=/work/model", *overrides])
    with pytest.raises(ValueError, match=rf"^{key}='/tmp/[a-z]+' is under /tmp, .*outside /tmp"):
        launcher.node_local_tmp_paths(cfg, env)


def test_trainer_accepts_tmp_on_one_node() -> None:
    launcher = _load(LAUNCHER, "mf_launcher_tmp")
    cfg = load_config(None, ["model.hf_path=/tmp/model", "checkpoint.save_dir=/tmp/ck", "logging.dir=/tmp/run"])
    launcher.node_local_tmp_paths(cfg, {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    launcher.node_local_tmp_paths(cfg, {})
