"""Contract tier: the SGLang native HTTP API, asserted over raw HTTP against every backend in BACKENDS.

`engine` starts one server per backend for the whole session (a real SGLang start costs ~30 s): modules
share it and leave it as they found it (a module that changes its weights, label or memory puts the
checkpoint back with helpers.restore_checkpoint, which checks that it did); only a module that needs
another launch flag or model (API key, routed experts) starts its own through `launch_engine`.

Backends:
    "cpu"     megatron_flash.engines.local_server (its static decoder; MF_CONTRACT_DECODER=cb: transformers
              continuous batching), started here.
    "cuda"    the same server with --device cuda --dtype float32 (tests/gpu/test_gpu_contract.py runs the
              tier with MF_CONTRACT_BACKENDS=cuda on a GPU machine).
    "sglang"  real SGLang 0.5.23 on CPU. HOOK: add "sglang" to BACKENDS and provide
              tests/contract/sglang_backend.py with
                  start_sglang_server(model_dir, port, log_path, *, api_key=None) -> subprocess.Popen
              (imported only when that backend is requested).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import pytest

from megatron_flash.ports import free_ports

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# `make test` runs the local engine server; `make test-sglang` sets MF_CONTRACT_BACKENDS=sglang (real SGLang 0.5.23 on CPU,
# installed by tools/sglang_cpu/install.sh into .cache/sglang-venv).
BACKENDS = [b for b in os.environ.get("MF_CONTRACT_BACKENDS", "cpu").split(",") if b]
STARTUP_DEADLINE_S = {"cpu": 120.0, "cuda": 180.0, "sglang": 300.0}
LOCAL = ("cpu", "cuda")
"""Backends that are the project's own engine server (its extras and ids are asserted where SGLang differs)."""
LOCAL_BACKEND = "cuda" if "cuda" in BACKENDS else "cpu"
DECODER = os.environ.get("MF_CONTRACT_DECODER", "static")  # the local engine's decoder: static | cb
"""The local engine for modules that test its own endpoints."""



@dataclass
class EngineServer:
    backend: str
    url: str
    model_dir: str
    proc: subprocess.Popen
    log_path: str
    api_key: str | None = None

    @property
    def local(self) -> bool:
        return self.backend in LOCAL

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-num_chars:]
        except OSError:
            return "<no log>"

    def stop(self) -> None:
        if self.backend == "sglang":  # SGLang has child processes: stop the whole process group
            from tests.contract.sglang_backend import stop_sglang_server

            stop_sglang_server(self.proc)
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)


def _start_local_server(model_dir: str, port: int, log_path: str, *, api_key: str | None = None,
                      device: str = "cpu", extra_args: list[str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megatron_flash.engines.local_server", "--model-path", model_dir,
           "--port", str(port), "--host", "127.0.0.1", "--num-blocks", "64", "--page-size", "16",
           "--decoder", DECODER, "--log-level", "warning", "--device", device, "--dtype", "float32"]
    if DECODER == "cb":
        cmd += ["--max-batch-tokens", "256"]
    if api_key is not None:
        cmd += ["--api-key", api_key]
    cmd += extra_args or []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
    log = open(log_path, "w")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def launch_engine(backend: str, model_dir: str, log_dir: str, *, api_key: str | None = None,
                  sglang_args: list[str] | None = None, local_args: list[str] | None = None) -> EngineServer:
    """Start a server of `backend` on a free loopback port and wait (with a deadline) for /health.
    `sglang_args` / `local_args`: flags for that backend only (each server has its own switches)."""
    port = free_ports()
    log_path = os.path.join(log_dir, f"{backend}-{port}.log")
    if backend in LOCAL:
        proc = _start_local_server(model_dir, port, log_path, api_key=api_key, device=backend, extra_args=local_args)
    elif backend == "sglang":  # HOOK: provided by the real-SGLang tier
        from tests.contract.sglang_backend import start_sglang_server

        proc = start_sglang_server(model_dir, port, log_path, api_key=api_key, extra_args=sglang_args)
    else:
        raise ValueError(f"unknown backend {backend!r}; known: cpu, cuda, sglang")
    server = EngineServer(backend=backend, url=f"http://127.0.0.1:{port}", model_dir=model_dir, proc=proc,
                          log_path=log_path, api_key=api_key)
    deadline = time.monotonic() + STARTUP_DEADLINE_S[backend]
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{backend} server exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.25)
    server.stop()
    raise AssertionError(f"{backend} server not healthy after {STARTUP_DEADLINE_S[backend]} s:\n{server.log_tail()}")


@pytest.fixture(scope="session", params=BACKENDS)
def engine(request: pytest.FixtureRequest, tiny_models: dict[str, str],
           tmp_path_factory: pytest.TempPathFactory) -> Any:
    # the local engine serves LoRA adapters only when asked (test_lora_adapters.py); SGLang gets its own server
    server = launch_engine(request.param, tiny_models["llama"], str(tmp_path_factory.mktemp("engine_logs")),
                           local_args=["--enable-lora"])
    yield server
    server.stop()


@pytest.fixture(scope="session")
def engine_url(engine: EngineServer) -> str:
    return engine.url
