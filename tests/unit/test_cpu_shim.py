"""The CPU shim patches only when CUDA is absent; with CUDA present it must change nothing."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import REPO


def run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={"PYTHONWARNINGS": "ignore", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_inert_when_cuda_is_available() -> None:
    out = run("""
        from unittest import mock
        import torch
        before = (torch.cuda.current_device, torch.Tensor.type, torch.Tensor.cuda)
        with mock.patch("torch.cuda.is_available", return_value=True):
            from megatron_flash.trainer.patches import cpu as cpu_shim
            applied = cpu_shim.apply()
        import megatron.core.pipeline_parallel.schedules as sched
        from megatron.core.tensor_parallel import random as r
        after = (torch.cuda.current_device, torch.Tensor.type, torch.Tensor.cuda)
        print(applied, before == after, sched.torch is torch, r.CudaRNGStatesTracker.__name__)
    """)
    assert out == "False True True CudaRNGStatesTracker"


def test_applied_without_cuda_redirects_megatron_only() -> None:
    out = run("""
        import torch
        from megatron_flash.trainer.patches import cpu as cpu_shim
        applied = cpu_shim.apply()
        import megatron.core.pipeline_parallel.schedules as sched
        t = sched.torch.zeros([], dtype=torch.int, device="cuda")   # megatron's own call pattern
        user_type = torch.zeros(2).type()                           # user code keeps the real name
        try:
            torch.zeros(2).cuda(); user_cuda = "no error"
        except (AssertionError, RuntimeError):
            user_cuda = "raises"
        print(applied, t.device.type, user_type, user_cuda, torch.cuda.current_device())
    """)
    assert out == "True cpu torch.FloatTensor raises cpu"
