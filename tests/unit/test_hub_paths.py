"""model.hf_path as a Hub id, resolved through a Hugging Face cache this test lays out itself (nothing is
downloaded): offline mode finds the snapshot, a missing id is an error naming it, a local directory is
used as it is, and the launcher turns a miss into a config error."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO

REVISION = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root, repo_id: str) -> str:
    """The layout huggingface_hub reads: models--org--name/{refs/main, snapshots/<rev>/...}."""
    repo = os.path.join(root, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", REVISION)
    os.makedirs(snapshot)
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(REVISION)
    with open(os.path.join(snapshot, "config.json"), "w") as f:
        json.dump({"model_type": "llama"}, f)
    return snapshot


def resolve_in_child(value: str, cache: str) -> subprocess.CompletedProcess:
    code = ("import sys; from megatron_flash.hf.hub import resolve_model_path\n"
            "try:\n    print(resolve_model_path(sys.argv[1]))\nexcept ValueError as e:\n    print('ERR', e)")
    env = {**os.environ, "HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "1", "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-c", code, value], capture_output=True, text=True, env=env, timeout=60)


def test_a_cached_hub_id_resolves_offline_to_its_snapshot(tmp_path) -> None:
    snapshot = hub_cache(tmp_path / "hub", "HuggingFaceTB/SmolLM2-135M-Instruct")
    out = resolve_in_child("HuggingFaceTB/SmolLM2-135M-Instruct", str(tmp_path / "hub"))
    assert os.path.realpath(out.stdout.strip()) == os.path.realpath(snapshot), out.stderr


def test_a_missing_hub_id_is_named_with_the_cache_and_offline_mode(tmp_path) -> None:
    (tmp_path / "hub").mkdir()
    out = resolve_in_child("someone/not-there", str(tmp_path / "hub"))
    assert out.stdout.startswith("ERR model.hf_path='someone/not-there'"), out.stdout + out.stderr
    assert str(tmp_path / "hub") in out.stdout and "HF_HUB_OFFLINE=1" in out.stdout


def test_paths_that_are_not_hub_ids_are_left_to_the_model_loader(tmp_path) -> None:
    from megatron_flash.hf.hub import resolve_model_path

    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    missing = str(tmp_path / "missing" / "dir" / "x")  # reported where the model is read, as before
    assert resolve_model_path(missing) == missing
    assert resolve_model_path("runs/quickstart/warm_model") == "runs/quickstart/warm_model"


def test_the_launcher_reports_a_missing_model_as_a_config_error(tmp_path) -> None:
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, os.path.join(REPO, "launch/pretrain_async_rl.py"),
                          "model.hf_path=someone/not-there", "data.task=sort4"],
                         capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    assert out.returncode != 0 and "model.hf_path='someone/not-there'" in out.stderr, out.stderr[-2000:]
