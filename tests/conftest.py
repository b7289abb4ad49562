"""Shared fixtures: tiny HF checkpoints made once per test session (offline, deterministic)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def run_tool(args: list[str], *, nproc: int = 1, timeout: float = 300, check: bool = True,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a repo script with python (nproc=1) or torchrun (nproc>1); 1 thread per process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    if nproc == 1:
        cmd = [sys.executable] + args
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--standalone"] + args
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                             f"stderr:\n{proc.stderr[-5000:]}")
    return proc


def json_rows(stdout: str) -> list[dict]:
    """Every JSON object printed on `stdout`. Ranks of one torchrun share the pipe, so two ranks' rows can
    land on one line (one rank's newline written after the other's row): objects are decoded one after
    another wherever a line holds `{`, not one per line."""
    decoder, rows = json.JSONDecoder(), []
    for line in stdout.splitlines():
        i = line.find("{")
        while 0 <= i < len(line):
            try:
                obj, end = decoder.raw_decode(line, i)
            except json.JSONDecodeError:
                break
            if isinstance(obj, dict):
                rows.append(obj)
            i = line.find("{", end)
    return rows


def memfd_links(pid: int | str = "self") -> list[str]:
    """The staged-ipc buffers (memfd `mf-weights-*`) a process holds open file descriptors to."""
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed between listdir and readlink
            pass
    return [t for t in links if t.startswith("/memfd:mf-weights")]


def hf_weights(path: str) -> dict:
    """Every tensor of the HF checkpoint directory `path` (all its *.safetensors shards)."""
    import glob

    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(f))
    return out


def make_tiny_models(arg_lists: list[list[str]]) -> None:
    """tools/make_tiny_model.py once per argument list, all in one process: importing torch and
    transformers costs more than making a tiny model (the tool's output depends on its arguments only)."""
    code = "import json, sys\nfrom tools.make_tiny_model import main\nfor argv in json.loads(sys.argv[1]): main(argv)"
    run_tool(["-c", code, json.dumps(arg_lists)])


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_models")
    out = {arch: str(root / arch) for arch in ("llama", "qwen2", "qwen3", "qwen3_moe")}
    make_tiny_models([["--out", path, "--arch", arch, "--seed", "0"] for arch, path in out.items()])
    return out


@pytest.fixture(scope="session")
def seed1_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama with other weights (seed 1): the target of weight-update tests."""
    path = str(tmp_path_factory.mktemp("seed1") / "llama")
    run_tool(["tools/make_tiny_model.py", "--out", path, "--arch", "llama", "--seed", "1"])
    return path


@pytest.fixture(scope="session")
def four_layer_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A four-layer tiny Llama: two layers per stage and chunk under PP2 × VPP2."""
    path = str(tmp_path_factory.mktemp("four_layers") / "llama")
    run_tool(["tools/make_tiny_model.py", "--out", path, "--arch", "llama", "--num-layers", "4", "--seed", "3"])
    return path


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu(n): needs n CUDA GPUs")
    _own_port_range()


def _own_port_range() -> None:
    """Under pytest-xdist each worker (and every process it starts) draws engine, gateway and
    rendezvous ports from a range of its own: two workers could otherwise draw one port between a
    check and a server's bind (megatron_flash.ports)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not worker.startswith("gw") or not count.isdigit() or "MF_PORT_RANGE" in os.environ:
        return
    from megatron_flash.ports import ephemeral_range

    low, high = 20000, ephemeral_range()[0] - 1
    span = (high - low + 1) // int(count)
    start = low + int(worker[2:]) * span
    os.environ["MF_PORT_RANGE"] = f"{start}-{start + span - 1}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests are skipped only for lack of GPUs: never by default, never by a flag."""
    try:
        import torch

        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        available = 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = int(marker.args[0]) if marker.args else 1
        if available < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPU(s), this machine has {available}"))
