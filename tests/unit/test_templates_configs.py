"""Every shipped config with every Slurm template: the template renders (launch/slurm/render.py, DRY_RUN),
each trainer command it prints resolves to a valid config through the real entry point, and the
config's engines.server_args reach the engines: as the trainer's own launch settings where the trainer
starts them (single node), as the flags of each server the template starts where it attaches to them
(multi-node; the trainer then gets engines.server_args={})."""

from __future__ import annotations

import importlib.util
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from megatron_flash.config import load_config

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "launch" / "slurm"
TEMPLATES = {"single_node_colocated": "gpu07", "single_node_split": "gpu07",
             "multi_node_disaggregated": "gpu[01-03]"}
# loss_tis.yaml holds a loss section only: it composes with another config, as its comment shows
CONFIGS = {p.stem: f"configs/{p.name}" for p in sorted((REPO / "configs").glob("*.yaml")) if p.stem != "loss_tis"}
CONFIGS["quickstart_cpu+loss_tis"] = "configs/quickstart_cpu.yaml configs/loss_tis.yaml"

_spec = importlib.util.spec_from_file_location("mf_slurm_render_configs", SLURM / "render.py")
render = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = render
_spec.loader.exec_module(render)


def test_every_config_file_is_covered() -> None:
    covered = {f for files in CONFIGS.values() for f in files.split()}
    assert covered == {f"configs/{p.name}" for p in (REPO / "configs").glob("*.yaml")}


def _env(config: str) -> dict[str, str]:
    env = {"MODEL_PATH": "/ckpt/model", "CONFIG": config, "TRAIN_NODES": "1"}
    if "_cpu" in config:  # CPU hosts: the project's own engine server, one process per "GPU"
        env.update(ENGINE_BACKEND="local", ENGINE_TP="1", GPUS_PER_NODE="2", TRAIN_GPUS="1")
    return env


def _server_args(config: str) -> dict:
    return load_config([REPO / f for f in config.split()], ["model.hf_path=/ckpt/model"]).engines.server_args


@pytest.mark.parametrize("template", list(TEMPLATES))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_renders_and_loads_with_template(name: str, template: str) -> None:
    config = CONFIGS[name]
    r = render.render(SLURM / f"{template}.sbatch", nodelist=TEMPLATES[template], gpus_per_node=2 if "_cpu" in config
                      else 8, job_id="77", env=_env(config), overrides=[])
    trainers = r.role("trainer")
    assert trainers, r.output
    done = render.check_trainer_config(trainers[0])
    assert done.returncode == 0, f"{name} with {template}: {done.stderr.strip()}"
    resolved = yaml.safe_load(done.stdout)
    wanted = _server_args(config)
    if template == "multi_node_disaggregated":
        assert resolved["engines"]["server_args"] == {}
        flags = shlex.join(render_flags(wanted))
        for engine in r.role("engine"):
            assert flags in engine.text, (flags, engine.text)
    else:  # the trainer launches the engines with its own engines.server_args
        got = dict(resolved["engines"]["server_args"])
        if template == "single_node_colocated" and "_cpu" not in config:  # its ENGINE_MEM_FRACTION (0.5) decides
            assert got.pop("mem-fraction-static") == 0.5
            wanted = {k: v for k, v in wanted.items() if k != "mem-fraction-static"}
        assert wanted.items() <= got.items()


def render_flags(server_args: dict) -> list[str]:
    """The flags a server gets for a mapping, written out here: --key-with-dashes value."""
    out: list[str] = []
    for key, value in server_args.items():
        flag = "--" + key.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


def test_smollm2_config_goes_to_the_multi_node_template_with_its_engine_flags() -> None:
    config = CONFIGS["smollm2_arith_cpu"]
    assert _server_args(config) == {"max_running_requests": 32, "context_length": 160}
    r = render.render(SLURM / "multi_node_disaggregated.sbatch", nodelist="n[1-3]", gpus_per_node=1, job_id="78",
                      env=_env(config) | {"GPUS_PER_NODE": "1", "ENGINE_ARGS": "--context-length 200"},
                      overrides=["engines.server_args.max_running_requests=16"])
    engines = r.role("engine")
    assert len(engines) == 2
    for engine in engines:  # the run's override wins over the file, ENGINE_ARGS come last (they win in the server)
        assert engine.text.endswith("--max-running-requests 16 --context-length 160 --context-length 200"), engine.text
