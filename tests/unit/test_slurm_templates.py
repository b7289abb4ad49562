"""The Slurm templates in launch/slurm, rendered in DRY_RUN with fake scontrol/srun/hostname
(launch/slurm/render.py): syntax, sections, node roles, torchrun rendezvous, GPU splits, engine
commands vs EngineCommand, engine URLs vs the trainer's overrides, the API key, and the trainer's
config resolved by the real entry point (--print-config).

Layouts rendered (8 GPUs per node):

    template                        nodes               trainer                 engines
    single_node_colocated           gpu07               torchrun 8 ranks        8 x TP1 on GPUs 0-7 (same GPUs)
    single_node_split               gpu07               torchrun 4 ranks        4 x TP1 on GPUs 4-7 (rank 0)
    multi_node_disaggregated        gpu[01-04]          gpu01-02, 2 x 8 ranks   gpu03-04, 4 x TP2 each (srun)
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest
import yaml

from megatron_flash.config import load_config
from megatron_flash.engines.launcher import EngineCommand, EngineLauncher

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "launch" / "slurm"
TEMPLATES = sorted(SLURM.glob("*.sbatch"))
SECRET = "mf-test-secret-7f3a91"  # must never appear in anything a template prints
MODEL = "/ckpt/model"
USER_OVERRIDE = "weight_sync.bucket_mb=256"
API_KEY_REF = "${oc.env:SGLANG_API_KEY}"

_spec = importlib.util.spec_from_file_location("mf_slurm_render", SLURM / "render.py")
render = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = render  # dataclasses look their module up while the class is built
_spec.loader.exec_module(render)


def _render(name: str, nodelist: str, **env: str) -> "render.Rendering":
    return render.render(SLURM / f"{name}.sbatch", nodelist=nodelist, gpus_per_node=8, job_id="4242",
                         env={"MODEL_PATH": MODEL, "SGLANG_API_KEY": SECRET, **env}, overrides=[USER_OVERRIDE])


@pytest.fixture(scope="module")
def rendered() -> Dict[str, "render.Rendering"]:
    return {
        "single_node_colocated": _render("single_node_colocated", "gpu07"),
        "single_node_split": _render("single_node_split", "gpu07"),
        "multi_node_disaggregated": _render("multi_node_disaggregated", "gpu[01-04]", TRAIN_NODES="2"),
    }


def _flag(argv: List[str], name: str) -> str:
    values = [w.split("=", 1)[1] for w in argv if w.startswith(name + "=")]
    assert len(values) == 1, (name, argv)
    return values[0]


def _override(node: "render.NodeCommand", key: str) -> object:
    """The last value the trainer's command line gives `key` (later overrides win), YAML-parsed."""
    values = [w.split("=", 1)[1] for w in node.script_args if w.startswith(key + "=")]
    assert values, (key, node.script_args)
    return yaml.safe_load(values[-1])


def _resolved(node: "render.NodeCommand") -> dict:
    done = render.check_trainer_config(node, api_key=SECRET)
    assert done.returncode == 0, done.stderr
    assert SECRET not in done.stdout  # --print-config redacts the key
    return yaml.safe_load(done.stdout)


# ---------------------------------------------------------------------------------------- the files
def test_templates_exist() -> None:
    assert [t.stem for t in TEMPLATES] == ["multi_node_disaggregated", "rollout_workers", "single_node_colocated",
                                           "single_node_split"]


@pytest.mark.parametrize("path", [*TEMPLATES, SLURM / "common.sh"], ids=lambda p: p.name)
def test_bash_syntax(path: Path) -> None:
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_three_sections_and_cluster_flags(path: Path) -> None:
    text = path.read_text()
    marks = [m.group(1) for m in re.finditer(r"^# =+ (\w+)$", text, re.M)]
    assert marks == ["SBATCH", "environment", "launch"]
    sbatch_part = text.split("# " + "=" * 10)[1]
    sbatch_lines = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert all(line in sbatch_part for line in sbatch_lines)  # every directive in the SBATCH section
    flags = " ".join(sbatch_lines)
    for flag in ("--exclusive", "--gpus-per-node=", "--time=", "--signal=B:USR1@", "--output=", "--nodes="):
        assert flag in flags, (path.name, flag)


def test_hostlist_expansion() -> None:
    assert render.expand_hostlist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert render.expand_hostlist("gpu[08-10]") == ["gpu08", "gpu09", "gpu10"]
    assert render.expand_hostlist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    with pytest.raises(ValueError):
        render.expand_hostlist("gpu[a-b]")


# ---------------------------------------------------------------------------------------- multi-node
def test_multi_node_roles(rendered: Dict) -> None:
    r = rendered["multi_node_disaggregated"]
    roles = {(n.host, n.role) for n in r.nodes}
    assert {h for h, role in roles if role == "trainer"} == {"gpu01", "gpu02"}
    assert {(h, role) for h, role in roles if role.startswith("engine")} == {
        (h, f"engine{i}") for h in ("gpu03", "gpu04") for i in range(4)}
    # one srun step per engine node, one for all trainer nodes
    assert sum(s.startswith("srun --nodes=1 --ntasks=1 --nodelist=gpu03 ") for s in r.steps) == 1
    assert sum(s.startswith("srun --nodes=1 --ntasks=1 --nodelist=gpu04 ") for s in r.steps) == 1
    trainer_steps = [s for s in r.steps if "--nodelist=gpu01,gpu02" in s and "torchrun" in s]
    assert len(trainer_steps) == 1 and "--nodes=2 --ntasks-per-node=1" in trainer_steps[0]
    assert "dry run: nothing was started" in r.output


def test_multi_node_rendezvous(rendered: Dict) -> None:
    trainers = rendered["multi_node_disaggregated"].role("trainer")
    assert len(trainers) == 2
    assert trainers[0].argv == trainers[1].argv  # the same command on every training node
    argv = trainers[0].argv
    assert argv[0] == "torchrun" and argv[argv.index("launch/pretrain_async_rl.py") - 1].startswith("--rdzv_id")
    assert _flag(argv, "--nnodes") == "2"
    assert _flag(argv, "--nproc_per_node") == "8"
    assert _flag(argv, "--rdzv_backend") == "c10d"
    assert _flag(argv, "--rdzv_endpoint") == "gpu01:29500"  # the first training node
    assert _flag(argv, "--rdzv_id") == "4242"
    assert "--standalone" not in argv


def test_multi_node_engines_are_launcher_commands(rendered: Dict) -> None:
    engines = rendered["multi_node_disaggregated"].role("engine")
    assert len(engines) == 8
    sglang = EngineCommand.sglang(python="python")
    for node in engines:
        i = int(node.role[len("engine"):])
        # What EngineLauncher would run for this engine; the key stays a variable the node expands.
        assert node.argv == sglang.build(model_path=MODEL, host=node.host, port=30000 + i, tp_size=2,
                                         api_key="$SGLANG_API_KEY"), node.text
        assert node.env == {"CUDA_VISIBLE_DEVICES": f"{2 * i},{2 * i + 1}"}


def test_multi_node_engine_steps_run_each_printed_command_under_the_restart_loop(rendered: Dict) -> None:
    """Each engine node's srun step runs exactly the commands printed for that node, each under
    launch/slurm/engine_loop.sh with ENGINE_MAX_RESTARTS (3) and its own log."""
    import shlex

    r = rendered["multi_node_disaggregated"]
    for host in ("gpu03", "gpu04"):
        (step,) = [s for s in r.steps if s.startswith(f"srun --nodes=1 --ntasks=1 --nodelist={host} ")]
        words = shlex.split(step.rstrip(" &"))
        script = words[words.index("-c") + 1]
        loops = [shlex.split(part[part.index("bash launch/slurm/engine_loop.sh"):])
                 for part in script.split(" & ") if "engine_loop.sh" in part]
        printed = [n.text for n in r.role("engine") if n.host == host]
        assert len(loops) == len(printed) == 4
        for i, (loop, text) in enumerate(zip(loops, printed)):
            assert loop[:3] == ["bash", "launch/slurm/engine_loop.sh", "3"], loop
            assert loop[3] == f"logs/slurm/4242/engine-{host}-{i}.log"
            assert loop[4] == text  # the server command, the key still a variable for the node
        assert SECRET not in step


def test_multi_node_trainer_takes_workers_unless_fleet_port_is_0(rendered: Dict) -> None:
    (trainer, _) = rendered["multi_node_disaggregated"].role("trainer")
    assert _override(trainer, "engines.join_port") == 29700 and _override(trainer, "engines.join_host") == "node"
    assert _override(trainer, "engines.join_address_file") == "logs/slurm/4242/fleet.json"
    assert _resolved(trainer)["engines"]["join_port"] == 29700  # a config the trainer accepts
    off = _render("multi_node_disaggregated", "gpu[01-04]", TRAIN_NODES="2", FLEET_PORT="0")
    assert not any(w.startswith("engines.join_port=") for w in off.role("trainer")[0].script_args)
    with pytest.raises(render.RenderError, match="FLEET_PORT must be an integer"):
        _render("multi_node_disaggregated", "gpu[01-04]", TRAIN_NODES="2", FLEET_PORT="x")


def test_rollout_workers_start_engines_and_a_worker_per_node_for_the_training_job() -> None:
    """TRAIN_JOB=77: every node runs GPUS_PER_NODE / ENGINE_TP engines under the restart loop and one
    launch/fleet_worker.py naming them and the training job's address file; the key stays a variable."""
    import shlex

    def workers(nodelist: str, overrides: tuple = (), **env: str) -> "render.Rendering":
        return render.render(SLURM / "rollout_workers.sbatch", nodelist=nodelist, gpus_per_node=8, job_id="4243",
                             env={"MODEL_PATH": MODEL, "SGLANG_API_KEY": SECRET, **env}, overrides=overrides)

    r = workers("spot[1-2]", TRAIN_JOB="77")
    sglang = EngineCommand.sglang(python="python")
    for host in ("spot1", "spot2"):
        engines = [n for n in r.role("engine") if n.host == host]
        assert [n.argv for n in engines] == [sglang.build(model_path=MODEL, host=host, port=30000 + i, tp_size=2,
                                                          api_key="$SGLANG_API_KEY") for i in range(4)]
        (worker,) = [n for n in r.role("worker") if n.host == host]
        assert worker.argv == ["python", "launch/fleet_worker.py", "--address-file", "logs/slurm/77/fleet.json",
                               *[w for i in range(4) for w in ("--engine", f"http://{host}:{30000 + i}")],
                               "--tp-size", "2", "--serves", MODEL, "--poll-s", "2"]
        (step,) = [s for s in r.steps if s.startswith(f"srun --nodes=1 --ntasks=1 --nodelist={host} ")]
        script = shlex.split(step.rstrip(" &"))[-1]
        assert script.count("engine_loop.sh") == 4 and worker.text in script
        assert script.index("trap stop TERM USR1 INT") < script.index("engine_loop.sh")  # before anything starts
        assert SECRET not in step
    by_file = workers("spot1", FLEET_ADDRESS="/shared/run/fleet.json", ENGINE_TP="8")
    assert by_file.role("worker")[0].argv[3] == "/shared/run/fleet.json" and len(by_file.role("engine")) == 1
    with pytest.raises(render.RenderError, match="set TRAIN_JOB"):
        workers("spot1")
    with pytest.raises(render.RenderError, match="TRAIN_JOB must be a Slurm job id"):
        workers("spot1", TRAIN_JOB="../x")
    with pytest.raises(render.RenderError, match="set CONFIG, or pass none"):  # overrides would do nothing
        workers("spot1", (USER_OVERRIDE,), TRAIN_JOB="77")
    with_config = workers("spot1", (USER_OVERRIDE,), TRAIN_JOB="77", CONFIG="configs/quickstart_cpu.yaml",
                          ENGINE_BACKEND="local", ENGINE_TP="1", GPUS_PER_NODE="1")
    assert with_config.role("engine")[0].argv[:4] == ["python", "-m", "megatron_flash.engines.local_server",
                                                      "--model-path"]


def test_engine_loop_restarts_a_server_up_to_max_then_gives_up(tmp_path: Path) -> None:
    # A "server" that exits with code 7 and counts its starts: MAX_RESTARTS=2 → 3 starts, exit 7.
    count, log = tmp_path / "starts", tmp_path / "engine.log"
    cmd = f"echo start >> {count}; exit 7"
    done = subprocess.run(["bash", str(SLURM / "engine_loop.sh"), "2", str(log), cmd],
                          env={**os.environ, "RESTART_DELAY_S": "0"}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 7, done.stderr
    assert count.read_text().split() == ["start"] * 3
    text = log.read_text()
    assert text.count("server exited with code 7; starting it again") == 2
    assert "after 2 restart(s) (MAX_RESTARTS=2): it stays down" in text
    bad = subprocess.run(["bash", str(SLURM / "engine_loop.sh"), "x", str(log), "true"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "MAX_RESTARTS" in bad.stderr


def test_engine_loop_sigterm_stops_the_server_and_the_loop(tmp_path: Path) -> None:
    # The server is a sleep that records its pid; SIGTERM to the loop must end both, with no restart.
    pid_file, log = tmp_path / "server.pid", tmp_path / "engine.log"
    cmd = f"echo $$ > {pid_file}; exec sleep 300"
    loop = subprocess.Popen(["bash", str(SLURM / "engine_loop.sh"), "5", str(log), cmd])
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        server = int(pid_file.read_text())
        loop.send_signal(signal.SIGTERM)
        assert loop.wait(timeout=30) == 143
    finally:
        if loop.poll() is None:
            loop.kill()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{server}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{server}") or open(f"/proc/{server}/stat").read().split()[2] == "Z"
    assert "starting it again" not in log.read_text()


def test_multi_node_urls_match_engines(rendered: Dict) -> None:
    r = rendered["multi_node_disaggregated"]
    served = [f"http://{n.argv[n.argv.index('--host') + 1]}:{n.argv[n.argv.index('--port') + 1]}"
              for n in r.role("engine")]
    trainer = r.role("trainer")[0]
    assert _override(trainer, "engines.urls") == served
    assert _override(trainer, "engines.num_engines") == 8
    assert _override(trainer, "engines.tp_size") == 2
    assert _override(trainer, "engines.backend") == "attach"
    assert _override(trainer, "weight_sync.transport") == "broadcast"
    assert all(url in r.output for url in served[:1])  # the health wait names them too
    assert re.search(r"^# wait up to \d+s for GET <url>/health", r.output, re.M)


def test_api_key_passed_and_never_printed(rendered: Dict) -> None:
    for name, r in rendered.items():
        assert SECRET not in r.output and SECRET not in r.stderr, name
        for trainer in r.role("trainer"):
            assert f"engines.api_key={API_KEY_REF}" in trainer.script_args
    for engine in rendered["multi_node_disaggregated"].role("engine"):
        assert engine.argv[engine.argv.index("--api-key") + 1] == "$SGLANG_API_KEY"
    unset = _render("multi_node_disaggregated", "gpu[01-04]", SGLANG_API_KEY="")
    assert "generated one for this job (not printed)" in unset.output


def test_usr1_signals_trainer_ranks_not_torchrun(rendered: Dict) -> None:
    for name, r in rendered.items():
        line = next(line for line in r.output.splitlines() if line.startswith("# on USR1: + "))
        assert "srun --overlap" in line and "pkill -TERM -P" in line, name
        pidfile = "/tmp/megatron-flash-4242-torchrun.pid"
        assert line.endswith(pidfile)
        trainer_step = next(s for s in r.steps if "torchrun" in s)
        assert f"exec \"$@\"' {pidfile} torchrun " in trainer_step  # torchrun's own pid is the one recorded


def test_user_overrides_come_last(rendered: Dict) -> None:
    for name, r in rendered.items():
        for trainer in r.role("trainer"):
            args = trainer.script_args
            if name == "multi_node_disaggregated":  # the servers started there took engines.server_args
                assert args[-1] == "engines.server_args={}"
                args = args[:-1]
            assert args[-1] == USER_OVERRIDE, name
            assert trainer.script_args[:2] == ["--config", {
                "multi_node_disaggregated": "configs/qwen3_32b_rlvr_gpu.yaml"}.get(name, "configs/qwen3_8b_rlvr_gpu.yaml")]


def test_multi_node_config_resolves(rendered: Dict) -> None:
    r = rendered["multi_node_disaggregated"]
    cfg = _resolved(r.role("trainer")[0])
    assert cfg["engines"]["api_key"] == "<redacted>"
    assert cfg["engines"]["urls"] == _override(r.role("trainer")[0], "engines.urls")
    assert cfg["weight_sync"]["bucket_mb"] == 256
    assert cfg["model"]["hf_path"] == MODEL


def test_requeue_resumes(rendered: Dict) -> None:
    r = _render("multi_node_disaggregated", "gpu[01-04]", REQUEUE="1")
    assert "checkpoint.resume=true" in r.role("trainer")[0].script_args


# ---------------------------------------------------------------------------------------- single node
def _launched_gpus(node: "render.NodeCommand", monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> List[List[int]]:
    """The GPUs of each engine trainer rank 0 would launch (EngineLauncher's CUDA_VISIBLE_DEVICES)."""
    monkeypatch.setenv("SGLANG_API_KEY", SECRET)
    words = node.script_args
    configs = [words[i + 1] for i, w in enumerate(words) if w == "--config"]
    overrides = [w for w in words if "=" in w and not w.startswith("--")]
    cfg = load_config([REPO / c for c in configs], overrides)
    specs = EngineLauncher.from_config(cfg.engines, model_path=cfg.model.hf_path, run_dir=str(tmp_path)).specs()
    return [[int(g) for g in s.env["CUDA_VISIBLE_DEVICES"].split(",")] for s in specs]


def test_split_gpus(rendered: Dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (trainer,) = rendered["single_node_split"].nodes
    assert (trainer.host, trainer.role) == ("gpu07", "trainer")
    assert trainer.argv[:3] == ["torchrun", "--standalone", "--nproc_per_node=4"]
    assert _launched_gpus(trainer, monkeypatch, tmp_path) == [[4], [5], [6], [7]]  # disjoint from ranks 0-3
    cfg = _resolved(trainer)
    assert cfg["engines"]["backend"] == "sglang" and cfg["weight_sync"]["transport"] == "broadcast"

    six = _render("single_node_split", "gpu07", TRAIN_GPUS="6", ENGINE_TP="2").role("trainer")[0]
    assert _flag(six.argv, "--nproc_per_node") == "6"
    assert _launched_gpus(six, monkeypatch, tmp_path) == [[6, 7]]


def test_colocated_gpus(rendered: Dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (trainer,) = rendered["single_node_colocated"].nodes
    assert trainer.argv[:3] == ["torchrun", "--standalone", "--nproc_per_node=8"]
    assert _launched_gpus(trainer, monkeypatch, tmp_path) == [[g] for g in range(8)]  # the trainer's GPUs
    cfg = _resolved(trainer)
    assert cfg["weight_sync"]["transport"] == "ipc"
    assert cfg["engines"]["server_args"]["mem-fraction-static"] == 0.5
    assert cfg["engines"]["colocate"] is True and cfg["async_rl"]["alpha"] == 0  # time-shared


# ---------------------------------------------------------------------------------------- mistakes
@pytest.mark.parametrize("name,nodelist,env,message", [
    ("multi_node_disaggregated", "gpu[01-04]", {"TRAIN_NODES": "4"}, "leaves no engine node"),
    ("multi_node_disaggregated", "gpu[01-04]", {"ENGINE_TP": "3"}, "ENGINE_TP=3 must divide"),
    ("multi_node_disaggregated", "gpu[01-04]", {"MODEL_PATH": ""}, "set MODEL_PATH"),
    ("single_node_split", "gpu07", {"TRAIN_GPUS": "8"}, "leaves no GPU for engines"),
    ("single_node_split", "gpu[07-08]", {}, "runs on one node"),
    ("single_node_colocated", "gpu07", {"CONFIG": "configs/nope.yaml"}, "does not exist"),
    ("single_node_colocated", "gpu07", {"ENGINE_MEM_FRACTION": "1.5"}, "ENGINE_MEM_FRACTION"),
])
def test_bad_settings_fail_before_anything_runs(name: str, nodelist: str, env: Dict[str, str], message: str) -> None:
    with pytest.raises(render.RenderError, match=re.escape(message)):
        _render(name, nodelist, **env)


def test_render_cli_json(capsys: pytest.CaptureFixture) -> None:
    assert render.main([str(SLURM / "single_node_split.sbatch"), "--env", f"MODEL_PATH={MODEL}", "--json",
                        "--", USER_OVERRIDE]) == 0
    out = yaml.safe_load(capsys.readouterr().out)  # JSON is YAML
    assert [n["role"] for n in out["nodes"]] == ["trainer"] and out["nodes"][0]["argv"][-1] == USER_OVERRIDE
    assert render.main([str(SLURM / "single_node_split.sbatch"), "--env", "nonsense"]) == 2


# ---------------------------------------------------------------------------------------- real mode
# Not a dry run: the templates' own waiting, health checks, USR1 handling and clean-up, on this
# machine. Fake srun runs its command here (no node placement); fake torchrun is a shell with one
# "rank" child that records a SIGTERM and exits 0; the engines' PYTHON is a script serving /health.
FAKE_SRUN = """#!/bin/bash
out=
while [[ $# -gt 0 && $1 == --* ]]; do
    case $1 in --output=*) out=${1#--output=}; out=${out//%N/local} ;; esac
    shift
done
echo "srun $*" >> "$FAKE_DIR/srun.calls"
if [[ -n $out ]]; then exec "$@" >> "$out" 2>&1; else exec "$@"; fi
"""
FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
    "show hostnames") printf '%s\\n' $FAKE_HOSTS ;;
    "requeue "*) echo "$2" >> "$FAKE_DIR/requeued" ;;
    *) exit 1 ;;
esac
"""
FAKE_TORCHRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_DIR/torchrun.args"
printf '%s' "$SGLANG_API_KEY" > "$FAKE_DIR/trainer.key"
"$FAKE_PY" -c '
import os, signal, sys, time
def stop(*_):
    open(os.path.join(os.environ["FAKE_DIR"], "rank.sigterm"), "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(os.path.join(os.environ["FAKE_DIR"], "rank.started"), "w").close()
if os.environ["FAKE_RANK"] == "exit3":
    sys.exit(3)
time.sleep(60)
sys.exit(4)
' &
wait $!
"""
FAKE_ENGINE_PY = """
import json, os, signal, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
argv = sys.argv[1:]
port = argv[argv.index("--port") + 1]
with open(os.path.join(os.environ["FAKE_DIR"], f"engine-{port}.argv"), "w") as f:
    json.dump({"argv": argv, "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}, f)
def stop(*_):
    open(os.path.join(os.environ["FAKE_DIR"], f"engine-{port}.stopped"), "w").close()
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
ThreadingHTTPServer((argv[argv.index("--host") + 1], int(port)), Health).serve_forever()
"""


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


def _fake_cluster(tmp_path: Path, hosts: str, job_id: str, rank: str) -> Dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL, "torchrun": FAKE_TORCHRUN,
                       "fake_python": f"#!{sys.executable}\n" + FAKE_ENGINE_PY}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "FAKE_DIR": str(tmp_path),
            "FAKE_HOSTS": hosts, "FAKE_PY": sys.executable, "FAKE_RANK": rank, "SLURM_JOB_ID": job_id,
            "SLURM_JOB_NODELIST": hosts.replace(" ", ","), "SLURM_CPUS_ON_NODE": "2", "SLURM_GPUS_PER_NODE": "2",
            "SLURM_SUBMIT_DIR": str(REPO), "MODEL_PATH": MODEL, "SGLANG_API_KEY": SECRET,
            "LOG_DIR": str(tmp_path / "logs"), "PYTHON": str(bin_dir / "fake_python"),
            "MF_CONFIG_PYTHON": sys.executable}  # PYTHON is the fake engine: the config is read with the real one


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


def test_multi_node_real_mode_usr1_checkpoints_and_requeues(tmp_path: Path) -> None:
    job_id = f"77{tmp_path.stat().st_ino % 10**6}"
    env = _fake_cluster(tmp_path, "localhost 127.0.0.1", job_id, rank="wait")
    env.update(TRAIN_NODES="1", ENGINE_TP="1", BASE_PORT=str(_free_port_pair()), HEALTH_POLL_S="0.2",
               REQUEUE="1", ENGINE_STARTUP_TIMEOUT="20")
    proc = subprocess.Popen(["bash", str(SLURM / "multi_node_disaggregated.sbatch"), USER_OVERRIDE], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(tmp_path / "rank.started", proc)
        proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@... does near the time limit
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        Path(f"/tmp/megatron-flash-{job_id}-torchrun.pid").unlink(missing_ok=True)
    assert proc.returncode == 0, err
    assert (tmp_path / "rank.sigterm").exists()  # the rank, not torchrun, got SIGTERM and exited 0
    assert (tmp_path / "requeued").read_text().split() == [job_id]
    ports = [int(env["BASE_PORT"]), int(env["BASE_PORT"]) + 1]
    for gpu, port in enumerate(ports):
        engine = json.loads((tmp_path / f"engine-{port}.argv").read_text())
        assert engine["gpus"] == str(gpu)
        assert engine["argv"][engine["argv"].index("--api-key") + 1] == SECRET  # expanded on the node only
        assert (tmp_path / f"engine-{port}.stopped").exists()  # engines stopped after the trainer
    assert (tmp_path / "trainer.key").read_text() == SECRET
    args = (tmp_path / "torchrun.args").read_text().split("\n")
    assert f"engines.urls=[http://127.0.0.1:{ports[0]},http://127.0.0.1:{ports[1]}]" in args
    assert "checkpoint.resume=true" in args and args[-3:-1] == [USER_OVERRIDE, "engines.server_args={}"]
    assert SECRET not in out and SECRET not in err
    assert "engines healthy" in out and "USR1" in out


def test_single_node_real_mode_passes_the_trainer_exit_code(tmp_path: Path) -> None:
    job_id = f"78{tmp_path.stat().st_ino % 10**6}"
    env = _fake_cluster(tmp_path, "localhost", job_id, rank="exit3")
    env.update(GPUS_PER_NODE="8", REQUEUE="1")
    try:
        done = subprocess.run(["bash", str(SLURM / "single_node_split.sbatch")], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=30)
    finally:
        Path(f"/tmp/megatron-flash-{job_id}-torchrun.pid").unlink(missing_ok=True)
    assert done.returncode == 3, done.stderr
    assert "trainer exit code 3" in done.stdout
    assert not (tmp_path / "requeued").exists()  # no USR1: nothing to requeue
    assert "--nproc_per_node=4" in (tmp_path / "torchrun.args").read_text().split("\n")
