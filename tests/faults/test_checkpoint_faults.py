"""The fault tier, checkpoint side, on a real run (trainer + local engine):

1. SIGKILL while a checkpoint is being written (the moment its `step_N.tmp` directory appears): the
   previous checkpoint stays `latest`, whole; the partial one is never named by `latest`.
2. The run resumed from there on a "full disk": every file the trainer (and what it starts) writes is
   capped by RLIMIT_FSIZE, so the next checkpoint write fails with EFBIG as a real full disk fails
   with ENOSPC (this box gives no root to mount a small filesystem; weights go by broadcast, since
   the limit caps the staged ipc buffers, memfd files, as well). The run must stop within its
   deadline with an error naming the checkpoint directory, the cause and the checkpoint a resume
   would use; `latest` unchanged, no partial directory left, no engine left.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time

from megatron_flash.ports import free_ports
from tests.conftest import REPO

FILE_LIMIT = 256 * 1024  # far below one checkpoint shard of the tiny model, far above its logs


def command(model: str, run_dir: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "launch/pretrain_async_rl.py", "--config", "configs/quickstart_cpu.yaml",
            f"model.hf_path={model}", f"logging.dir={run_dir}", "trainer.total_steps=100",
            "trainer.global_batch_size=16", "trainer.micro_batch_size=16", "rollout.n_samples_per_prompt=4",
            "async_rl.alpha=1", f"engines.base_port={port}", "logging.wandb_mode=disabled",
            "logging.tensorboard=false", "rollout.reward=tests.e2e.toy_rewards:digit_fraction",
            f"checkpoint.save_dir={run_dir}/ckpt", "checkpoint.save_interval=1", "checkpoint.resume=true", *extra]


def full_disk() -> None:
    """In the child before exec: writes past FILE_LIMIT fail with EFBIG instead of killing (SIGXFSZ)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))


def latest(ckpt: str) -> str:
    with open(os.path.join(ckpt, "latest")) as f:
        return f.read().strip()


def test_kill_during_checkpoint_write_then_disk_full_keep_the_last_checkpoint(tiny_models, tmp_path) -> None:
    from tests.e2e.test_resume import assert_no_orphan

    run_dir = str(tmp_path / "run")
    ckpt = os.path.join(run_dir, "ckpt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "PYTHONWARNINGS": "ignore"}

    # 1. killed mid-write
    port = free_ports(1)
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(command(tiny_models["llama"], run_dir, port), cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        target = os.path.join(ckpt, "step_000002.tmp")  # the third checkpoint: two whole ones before it
        deadline = time.monotonic() + 240
        try:
            while not os.path.isdir(target) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.001)
            proc.send_signal(signal.SIGKILL)
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert os.path.isdir(target), (tmp_path / "first.log").read_text()[-3000:]
    assert_no_orphan(port)
    assert latest(ckpt) == "step_000001"
    assert os.path.isfile(os.path.join(ckpt, "step_000001", "meta.json"))
    assert not os.path.exists(os.path.join(target, "meta.json"))  # cut before it was whole

    # 2. resumed on a full disk
    port = free_ports(1)
    t0 = time.monotonic()
    with open(tmp_path / "second.log", "w") as log:
        # broadcast: the staged ipc buffers are memfd files, which the file-size limit caps as well
        proc = subprocess.Popen(command(tiny_models["llama"], run_dir, port, "weight_sync.transport=broadcast"),
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=full_disk)
        try:
            code = proc.wait(300)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = (tmp_path / "second.log").read_text()
    assert code != 0, text[-3000:]
    assert "resum" in text and "step_000001" in text, text[-3000:]
    message = next((line for line in text.splitlines() if "could not be written" in line), "")
    assert os.path.join(ckpt, "step_000002") in message and "File too large" in message, text[-3000:]
    assert os.path.join(ckpt, "step_000001") in message and "resume starts from" in message
    assert latest(ckpt) == "step_000001"
    assert sorted(n for n in os.listdir(ckpt) if n.endswith(".tmp")) == []  # the partial write was removed
    assert_no_orphan(port)
    metrics = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl")) if x.strip()]
    assert metrics[-1]["step"] == 2  # the resumed run trained step 2 and stopped at its checkpoint
    print(f"full disk: stopped {time.monotonic() - t0:.0f} s after start with: {message.strip()[:300]}")
