"""A wrong path in the config ends the launcher with one line naming the key and the path, exit code 2,
and no traceback, before any process group or model exists; under torchrun every rank exits alike and
only the node's first rank (LOCAL_RANK 0) speaks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# What read_hf_spec needs of a config.json (the launcher never loads weights before these checks).
LLAMA = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "hidden_size": 64, "vocab_size": 100,
         "intermediate_size": 128, "num_hidden_layers": 2}


def launch(*overrides: str, local_rank: str = "0") -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}, "LOCAL_RANK": local_rank,
           "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "launch/pretrain_async_rl.py", "--config", "configs/quickstart_cpu.yaml",
                           *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(LLAMA))
    return path


def test_a_model_folder_without_config_json(tmp_path: Path) -> None:
    line = one_line(launch(f"model.hf_path={tmp_path}"))
    assert line == f"config error: model.hf_path={str(tmp_path)!r} has no config.json: not a Hugging Face model " \
                   "directory"


def test_a_missing_model_folder_and_an_unsupported_architecture(tmp_path: Path, model_dir: Path) -> None:
    line = one_line(launch(f"model.hf_path={tmp_path}/nope"))
    assert line == f"config error: model.hf_path={str(tmp_path / 'nope')!r}: no such directory"
    (model_dir / "config.json").write_text(json.dumps({**LLAMA, "architectures": ["MistralForCausalLM"]}))
    line = one_line(launch(f"model.hf_path={model_dir}"))
    assert line.startswith("config error: model.hf_path: ") and "'MistralForCausalLM' is not supported" in line


def test_missing_data_and_replay_files(tmp_path: Path, model_dir: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    line = one_line(launch(f"model.hf_path={model_dir}", f"data.path={missing}"))
    assert line == f"config error: data.path={str(missing)!r}: no such file or directory"
    line = one_line(launch(f"model.hf_path={model_dir}", "trainer.mode=train_only", f"trainer.replay_path={missing}"))
    assert line == f"config error: trainer.replay_path={str(missing)!r}: no such file or directory"
    line = one_line(launch(f"model.hf_path={model_dir}", f"eval.datasets={{held: {{path: {missing}}}}}"))
    assert line == f"config error: eval.datasets.held.path={str(missing)!r}: no such file or directory"


def test_a_teacher_folder_without_config_json(tmp_path: Path, model_dir: Path) -> None:
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    line = one_line(launch(f"model.hf_path={model_dir}", f"distill.teacher={teacher}"))
    assert line == f"config error: distill.teacher={str(teacher)!r} has no config.json: not a Hugging Face model " \
                   "directory"


def test_other_ranks_exit_alike_in_silence(tmp_path: Path) -> None:
    proc = launch(f"model.hf_path={tmp_path}", local_rank="1")
    assert proc.returncode == 2 and not proc.stderr.strip(), proc.stderr[-3000:]
