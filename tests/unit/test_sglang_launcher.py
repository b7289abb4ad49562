"""EngineLauncher with a dummy "server" (python http.server answering /health): command building
from server_args, log files, start-up failures with the log tail, no orphans after stop, atexit and
SIGTERM cleanup, attach mode."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import List

import pytest

from megatron_flash.config.schema import EngineConfig
from megatron_flash.ports import free_ports
from megatron_flash.engines.launcher import (EngineCommand, EngineLauncher, EngineStartupError,
                                                    server_args_to_flags)

REPO = str(Path(__file__).resolve().parents[2])

DUMMY_SERVER = textwrap.dedent("""
    import argparse, os, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    p = argparse.ArgumentParser()
    for flag in ("--model-path", "--host", "--api-key", "--mode"):
        p.add_argument(flag)
    p.add_argument("--port", type=int)
    args, _ = p.parse_known_args()
    print("dummy argv", sys.argv[1:], flush=True)
    if args.mode == "fail":
        print("boom: unsupported flag --bad-flag", file=sys.stderr, flush=True)
        sys.exit(3)
    # A child of the server (like SGLang's scheduler processes): it must not outlive stop().
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print("grandchild", child.pid, flush=True)
    if args.mode == "hang":
        time.sleep(120)

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    ThreadingHTTPServer((args.host, args.port), Health).serve_forever()
""")


@pytest.fixture
def dummy(tmp_path: Path) -> EngineCommand:
    script = tmp_path / "dummy_server.py"
    script.write_text(DUMMY_SERVER)
    return EngineCommand((sys.executable, str(script)), tp_flag=None)



def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pids: List[int], timeout_s: float = 10.0) -> List[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def grandchildren(log_paths: List[str]) -> List[int]:
    pids = []
    for path in log_paths:
        match = re.search(r"^grandchild (\d+)$", Path(path).read_text(), re.M)
        assert match, Path(path).read_text()
        pids.append(int(match.group(1)))
    return pids


# -- command building (pure) ---------------------------------------------------------------------
def test_server_args_to_flags() -> None:
    flags = server_args_to_flags({"mem_fraction_static": 0.8, "--disable-cuda-graph": True, "enable-foo": False,
                                  "chunked-prefill-size": None, "cuda-graph-bs": [1, 2, 4], "empty": [],
                                  "json-model-override-args": {"rope_scaling": {"factor": 2}}})
    assert flags == ["--mem-fraction-static", "0.8", "--disable-cuda-graph", "--cuda-graph-bs", "1", "2", "4",
                     "--json-model-override-args", '{"rope_scaling": {"factor": 2}}']


def test_sglang_specs_assign_gpus_ports_and_flags(tmp_path: Path) -> None:
    launcher = EngineLauncher(backend="sglang", model_path="/models/qwen", num_engines=2, base_port=31000,
                              tp_size=2, gpu_ids=[4, 5, 6, 7], api_key="k", run_dir=str(tmp_path),
                              server_args={"mem-fraction-static": 0.8, "disable-cuda-graph": True},
                              env={"SGLANG_USE_CPU_ENGINE": "1"})
    first, second = launcher.specs()
    assert second.argv == (sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/qwen",
                           "--host", "127.0.0.1", "--port", "31001", "--tp-size", "2", "--api-key", "k",
                           "--mem-fraction-static", "0.8", "--disable-cuda-graph")
    assert (first.env["CUDA_VISIBLE_DEVICES"], second.env["CUDA_VISIBLE_DEVICES"]) == ("4,5", "6,7")
    assert second.env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert launcher.urls == ["http://127.0.0.1:31000", "http://127.0.0.1:31001"]
    assert second.log_path == os.path.join(str(tmp_path), "engines", "engine_1.log")
    # No gpu_ids: contiguous blocks after first_gpu (the trainer's GPUs come first).
    auto = EngineLauncher(backend="sglang", model_path="m", num_engines=2, first_gpu=2, host="0.0.0.0")
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in auto.specs()] == ["2", "3"]
    assert auto.urls[0] == "http://127.0.0.1:30000"  # bound to all interfaces, reached on loopback


def test_cpu_backend_and_config(tmp_path: Path) -> None:
    config = EngineConfig(backend="local", num_engines=2, base_port=32000, server_args={"num-blocks": 64})
    config.validate()
    launcher = EngineLauncher.from_config(config, model_path="/m", run_dir=str(tmp_path))
    spec = launcher.specs()[1]
    assert spec.argv == (sys.executable, "-m", "megatron_flash.engines.local_server", "--model-path", "/m",
                         "--host", "127.0.0.1", "--port", "32001", "--num-blocks", "64")
    assert "CUDA_VISIBLE_DEVICES" not in spec.env
    with pytest.raises(ValueError, match="tp_size must be 1"):
        EngineLauncher(backend="local", model_path="/m", tp_size=2).specs()
    with pytest.raises(ValueError, match="gpu_ids"):
        EngineLauncher(backend="sglang", model_path="/m", num_engines=2, gpu_ids=[0])
    with pytest.raises(ValueError, match="model_path"):
        EngineLauncher(backend="sglang")
    with pytest.raises(ValueError, match="backend"):
        EngineLauncher(backend="vllm", model_path="/m")


def test_colocated_sglang_engines_get_the_memory_saver(tmp_path: Path) -> None:
    """Colocated SGLang frees nothing on /release_memory_occupation without --enable-memory-saver;
    the config's own server_args are not modified, and a local engine gets no such flag."""
    config = EngineConfig(backend="sglang", colocate=True, server_args={"mem-fraction-static": 0.5})
    argv = EngineLauncher.from_config(config, model_path="/m", run_dir=str(tmp_path)).specs()[0].argv
    assert argv[-3:] == ("--mem-fraction-static", "0.5", "--enable-memory-saver")
    assert config.server_args == {"mem-fraction-static": 0.5}
    cpu = EngineLauncher.from_config(EngineConfig(backend="local", colocate=True), model_path="/m", run_dir=str(tmp_path))
    assert "--enable-memory-saver" not in cpu.specs()[0].argv


# -- processes -----------------------------------------------------------------------------------
def test_start_writes_logs_and_stop_leaves_no_process(tmp_path: Path, dummy: EngineCommand) -> None:
    base = free_ports(2)
    launcher = EngineLauncher(backend="local", model_path="/m", num_engines=2, base_port=base, api_key="secret",
                              run_dir=str(tmp_path), command=dummy, startup_timeout_s=30, stop_grace_s=5,
                              poll_interval_s=0.1, server_args={"extra-flag": 7})
    with launcher:
        urls = launcher.urls
        assert urls == [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
        logs = [s.log_path for s in launcher.specs()]
        servers = launcher.pids
        kids = grandchildren(logs)
        assert all(alive(p) for p in servers + kids)
        text = Path(logs[1]).read_text()
        assert text.startswith("# engine 1: ") and "--port " + str(base + 1) in text
        assert "<redacted>" in text.splitlines()[0] and "secret" not in text.splitlines()[0]
        assert "'--extra-flag', '7'" in text  # the dummy echoes its argv
    assert launcher.pids == []
    assert wait_dead(servers + kids) == []
    launcher.stop()  # idempotent


def test_server_exiting_during_startup_raises_with_log_tail(tmp_path: Path, dummy: EngineCommand) -> None:
    base = free_ports(2)
    launcher = EngineLauncher(backend="local", model_path="/m", num_engines=2, base_port=base, run_dir=str(tmp_path),
                              command=dummy, server_args={"mode": "fail"}, startup_timeout_s=30,
                              poll_interval_s=0.1, stop_grace_s=2)
    with pytest.raises(EngineStartupError) as info:
        launcher.start()
    message = str(info.value)
    assert re.search(r"engine \d \(http://127\.0\.0\.1:\d+\) exited with code 3 during start-up", message)
    assert "boom: unsupported flag --bad-flag" in message and "engine_" in message
    assert launcher.pids == []


def test_startup_deadline_raises_and_stops(tmp_path: Path, dummy: EngineCommand) -> None:
    launcher = EngineLauncher(backend="local", model_path="/m", base_port=free_ports(1), run_dir=str(tmp_path),
                              command=dummy, server_args={"mode": "hang"}, startup_timeout_s=1.5,
                              poll_interval_s=0.1, stop_grace_s=2)
    with pytest.raises(EngineStartupError, match=r"not healthy after 1.5s \(startup_timeout_s\)") as info:
        launcher.start()
    assert "grandchild" in str(info.value)  # the log tail
    kids = grandchildren([launcher.specs()[0].log_path])
    assert wait_dead(kids) == []


SUPERVISOR = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from megatron_flash.engines.launcher import EngineCommand, EngineLauncher
    launcher = EngineLauncher(backend="local", model_path="/m", base_port={port}, run_dir={run_dir!r},
                              command=EngineCommand((sys.executable, {script!r}), tp_flag=None),
                              startup_timeout_s=30, poll_interval_s=0.1, stop_grace_s=3)
    launcher.start()
    print("PIDS", *launcher.pids, flush=True)
    if {how!r} == "exit":
        sys.exit(0)  # no stop(): atexit must clean up
    time.sleep(60)
""")


@pytest.mark.parametrize("how", ["sigterm", "exit"])
def test_no_orphans_on_sigterm_or_exit(tmp_path: Path, dummy: EngineCommand, how: str) -> None:
    script = tmp_path / "supervisor.py"
    script.write_text(SUPERVISOR.format(repo=REPO, port=free_ports(1), run_dir=str(tmp_path), script=dummy.prefix[1],
                                        how=how))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), line + proc.stderr.read()
        servers = [int(p) for p in line.split()[1:]]
        kids = grandchildren([str(tmp_path / "engines" / "engine_0.log")])
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == (-signal.SIGTERM if how == "sigterm" else 0)
        assert wait_dead(servers + kids) == []
    finally:
        proc.kill()
        proc.wait()


def test_attach_mode_only_health_checks(tmp_path: Path, dummy: EngineCommand) -> None:
    port = free_ports(1)
    server = subprocess.Popen([*dummy.prefix, "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        config = EngineConfig(backend="attach", num_engines=1, urls=[f"http://127.0.0.1:{port}/"])
        config.validate()
        launcher = EngineLauncher.from_config(config, model_path="", run_dir=str(tmp_path), poll_interval_s=0.1)
        assert launcher.start() == [f"http://127.0.0.1:{port}"]
        assert launcher.pids == [] and not (tmp_path / "engines").exists()
        launcher.stop()
        assert server.poll() is None  # attach never stops what it did not start
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    dead = EngineLauncher(backend="attach", urls=[f"http://127.0.0.1:{free_ports(1)}"], startup_timeout_s=0.5,
                          poll_interval_s=0.1)
    with pytest.raises(EngineStartupError, match=r"engine 0 \(http://127\.0\.0\.1:\d+\) not healthy after 0.5s"):
        dead.start()
