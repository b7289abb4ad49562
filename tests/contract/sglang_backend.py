"""Start the real SGLang 0.5.23 server (CPU) for contract tests.

The server runs from the cached venv built by ``tools/sglang_cpu/install.sh`` and is launched by
``tools/sglang_cpu/launch.sh`` (which sets SGLANG_USE_CPU_ENGINE=1, the sgl_kernel stub and the
"file_system" sharing strategy, and the CPU flags). Start-up takes ~45-75 s on the 2-core box and
the server tree holds ~2.2 GB RSS (3 processes), so start one per test session.

    from tests.contract.sglang_backend import sglang_available, start_sglang_server, stop_sglang_server
    if sglang_available():
        proc = start_sglang_server("/tmp/tiny_llama", 31000, "runs/sglang.log")
        ...
        stop_sglang_server(proc)

Clients that send /update_weights_from_tensor must pickle with
``torch.multiprocessing.set_sharing_strategy("file_system")`` in the client process: a payload made
with the default "file_descriptor" strategy kills the server (scheduler AuthenticationError).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(REPO, "tools", "sglang_cpu")
LAUNCH = os.path.join(TOOLS, "launch.sh")
DEFAULT_VENV = os.path.join(REPO, ".cache", "sglang-venv")
START_TIMEOUT_S = float(os.environ.get("SGLANG_CPU_START_TIMEOUT", "240"))


def _venv() -> str:
    return os.environ.get("SGLANG_CPU_VENV", DEFAULT_VENV)


def sglang_available() -> bool:
    """True when install.sh has completed (venv python present and the stamp written)."""
    venv = _venv()
    return os.access(os.path.join(venv, "bin", "python"), os.X_OK) and os.path.isfile(
        os.path.join(venv, ".mf-sglang-stamp"))


def _log_tail(log_path: str, n_chars: int = 4000) -> str:
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n_chars))
            return f.read().decode(errors="replace")
    except OSError as e:
        return f"<no log: {e}>"


def _healthy(port: int, timeout_s: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def stop_sglang_server(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """Stop the server and its scheduler/detokenizer children (the whole process group)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def start_sglang_server(model_dir: str, port: int, log_path: str, *, api_key: str | None = None,
                        extra_args: list[str] | None = None,
                        timeout_s: float = START_TIMEOUT_S) -> subprocess.Popen:
    """Launch SGLang on 127.0.0.1:PORT serving MODEL_DIR and wait until GET /health answers 200.

    The process is the leader of a new session (process group): stop it with stop_sglang_server()
    (or os.killpg(proc.pid, SIGTERM)), which also ends its children. Output goes to LOG_PATH
    (appended). Raises RuntimeError with the log tail if the server exits or is not healthy within
    TIMEOUT_S; the process group is killed first.
    """
    if not sglang_available():
        raise RuntimeError(f"SGLang CPU venv not installed at {_venv()}: run tools/sglang_cpu/install.sh")
    os.makedirs(os.path.dirname(os.path.abspath(log_path)) or ".", exist_ok=True)
    cmd = ["bash", LAUNCH, model_dir, str(port), log_path]
    extra_args = list(extra_args or []) + (["--api-key", api_key] if api_key is not None else [])
    if extra_args:
        cmd += ["--", *extra_args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while time.monotonic() < deadline:
        rc = proc.poll()
        if rc is not None:
            raise RuntimeError(f"SGLang server exited with code {rc} during start-up; log {log_path}:\n"
                               f"{_log_tail(log_path)}")
        if _healthy(port):
            proc.startup_s = time.monotonic() - t0  # type: ignore[attr-defined]
            return proc
        time.sleep(1.0)
    stop_sglang_server(proc)
    raise RuntimeError(f"SGLang server not healthy on port {port} after {timeout_s:.0f} s; log {log_path}:\n"
                       f"{_log_tail(log_path)}")


__all__ = ["sglang_available", "start_sglang_server", "stop_sglang_server"]
