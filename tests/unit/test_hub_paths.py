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


def dataset_cache(root, repo_id: str) -> str:
    """A Hub dataset repository in the cache layout (datasets--org--name), two parquet splits."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = os.path.join(root, "datasets--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", REVISION)
    os.makedirs(os.path.join(snapshot, "data"))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(REVISION)
    for split, rows in (("train", [("What is 1 + 2?", "3"), ("What is 4 + 4?", "8")]), ("test", [("What is 9 + 1?", "10")])):
        table = pa.table({"question": [q for q, _ in rows], "answer": [a for _, a in rows]})
        pq.write_table(table, os.path.join(snapshot, "data", f"{split}-00000-of-00001.parquet"))
    return snapshot


class CharTokenizer:
    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [ord(c) for c in text]}


def test_a_cached_hub_dataset_loads_offline_with_its_split(tmp_path) -> None:
    snapshot = dataset_cache(tmp_path / "hub", "someone/arith-qa")
    code = ("import sys; from megatron_flash.hf.hub import resolve_dataset_path\n"
            "try:\n    print(resolve_dataset_path(sys.argv[1]))\nexcept ValueError as e:\n    print('ERR', e)")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", code, "someone/arith-qa"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert os.path.realpath(out.stdout.strip()) == os.path.realpath(snapshot), out.stdout + out.stderr
    miss = subprocess.run([sys.executable, "-c", code, "someone/absent"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert miss.stdout.startswith("ERR data.path='someone/absent'") and "HF_HUB_OFFLINE=1" in miss.stdout

    from megatron_flash.config.schema import DataConfig
    from megatron_flash.rollout.dataset import PromptDataset

    test = PromptDataset.from_config(DataConfig(path=snapshot, split="test", prompt_key="question", shuffle=False),
                                     CharTokenizer(), seed=0)
    assert [(p.text, p.answer) for p in test.prompts] == [("What is 9 + 1?", "10")]
    train = PromptDataset.from_config(DataConfig(path=snapshot, prompt_key="question", shuffle=False),
                                      CharTokenizer(), seed=0)
    assert [p.answer for p in train.prompts] == ["3", "8"]


def test_a_split_other_than_train_is_refused_for_a_single_file(tmp_path) -> None:
    import pytest

    from megatron_flash.config import load_config

    with pytest.raises(ValueError, match="data.split='test'"):
        load_config(None, [f"data.path={tmp_path}/p.jsonl", "data.split=test"])
