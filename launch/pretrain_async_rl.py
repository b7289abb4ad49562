"""Asynchronous RL post-training on Megatron-Core: the torchrun entry point.

Every rank runs this script. The config is schema defaults ← --config YAML file(s) ← key=value
overrides; it is validated before any process group, torch or Megatron import, so a typo costs
a second, not a cluster allocation.

1 CPU process (tiny model, built-in local engine; gloo):

    python launch/pretrain_async_rl.py --config configs/quickstart_cpu.yaml

    torchrun --standalone --nproc_per_node=2 launch/pretrain_async_rl.py \\
        --config configs/quickstart_cpu.yaml parallel.tensor_model_parallel_size=2

1 GPU node, 8 GPUs: torchrun starts the 4 trainer ranks (GPUs 0-3); rank 0 launches the SGLang
engines on GPUs 4-7 (see the comments at the top of the config):

    torchrun --standalone --nproc_per_node=4 launch/pretrain_async_rl.py \\
        --config configs/qwen3_8b_rlvr_gpu.yaml model.hf_path=/ckpt/Qwen3-8B data.path=/data/math.jsonl

N nodes (trainer on every node; c10d rendezvous on node 0's address; run on each node):

    torchrun --nnodes=$NNODES --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=$MASTER_ADDR:29500 --rdzv_id=$JOB_ID launch/pretrain_async_rl.py \\
        --config configs/qwen3_32b_rlvr_gpu.yaml model.hf_path=/ckpt/Qwen3-32B

On Slurm, launch/slurm/*.sbatch run these for you (colocated, split, or N trainer + M engine
nodes); `python launch/slurm/render.py TEMPLATE` prints what each node would run (docs/cluster.md).

Inspect the resolved config without starting anything:

    python launch/pretrain_async_rl.py --config configs/quickstart_cpu.yaml --print-config

Configs compose: --config may repeat (later files win), and overrides win over every file:

    python launch/pretrain_async_rl.py --config configs/quickstart_cpu.yaml \\
        --config configs/loss_tis.yaml async_rl.alpha=1

Exit codes: 0 done, 2 bad command line or config, 1 the run failed (the error says why).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
from typing import List, Optional

if importlib.util.find_spec("megatron_flash") is None:  # run from a checkout, not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_flash.config import ConfigError, RunConfig, config_to_yaml, load_config  # noqa: E402

EXIT_CONFIG_ERROR = 2


def _is_local_leader() -> bool:
    # Under torchrun every rank parses the config; one message per node is enough.
    return os.environ.get("LOCAL_RANK", "0") == "0"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", default=[], metavar="PATH",
                        help="YAML file of overrides to the schema defaults; repeatable, later files win")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML and exit")
    parser.add_argument("--print-engine-flags", choices=("sglang", "local"), metavar="BACKEND",
                        help="print, as shell words, the flags an engine server of BACKEND (sglang|local) started "
                             "outside the run gets from this config (engines.server_args and what the run needs), "
                             "and exit; the multi-node Slurm template passes them to the servers it starts")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides applied after the files, e.g. optimizer.lr=1e-5")
    return parser.parse_args(argv)


def engine_flags(cfg: RunConfig, backend: str) -> List[str]:
    """The server flags of this run's engines when something else starts them (engines.backend=attach
    in the multi-node template): the config's engines.server_args, plus LoRA serving and route capture
    where the run needs them."""
    from megatron_flash.engines.launcher import engine_server_args, server_args_to_flags

    lora = None
    if cfg.lora_sync_mode() == "adapter":
        from megatron_flash.controller.assembly import lora_serving

        lora = lora_serving(cfg)
    return server_args_to_flags(engine_server_args(cfg.engines, backend=backend, lora_adapters=lora,
                                                   return_routed_experts=cfg.trainer.moe_routing_replay == "rollout"))


def check_paths(cfg: RunConfig) -> None:
    """What the run reads from disk, checked on every rank before any process group: a wrong path is
    one line naming its key, not a traceback from deep inside start-up. ValueError otherwise."""
    from megatron_flash.config.schema import RUN_MODES
    from megatron_flash.hf.spec import read_hf_spec

    if not cfg.model.hf_path:
        raise ValueError("model.hf_path must be set: the HF checkpoint directory trainer and engines start from")
    models = [("model.hf_path", cfg.model.hf_path)]  # the KL reference model is this checkpoint too
    if cfg.distill.teacher:
        models.append(("distill.teacher", cfg.distill.teacher))
    for key, model in models:
        if not os.path.isdir(model):
            raise ValueError(f"{key}={model!r}: no such directory")
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"{key}={model!r} has no config.json: not a Hugging Face model directory")
    try:  # an architecture the trainer builds (the teacher is only served by engines)
        read_hf_spec(cfg.model.hf_path)
    except ValueError as err:  # unreadable JSON, an unsupported architecture: the message names the file
        raise ValueError(f"model.hf_path: {err}") from None
    mode = RUN_MODES[cfg.trainer.mode]
    paths = [("trainer.replay_path", cfg.trainer.replay_path)] if mode.replays else []
    if mode.generates and cfg.data.path and not cfg.agentic.env:  # env episodes draw no prompts
        paths.append(("data.path", cfg.data.path))  # a file, or a dataset's directory
    paths += [(f"eval.datasets.{name}.path", spec["path"]) for name, spec in cfg.eval.datasets.items()
              if spec.get("path")]
    for key, path in paths:
        if not os.path.exists(path):
            raise ValueError(f"{key}={path!r}: no such file or directory")
        if not os.access(path, os.R_OK | (os.X_OK if os.path.isdir(path) else 0)):
            raise ValueError(f"{key}={path!r}: not readable by this user")


def node_local_tmp_paths(cfg: RunConfig, env: "os._Environ[str] | dict[str, str]" = os.environ) -> None:
    """Paths under /tmp that the run's hosts cannot share, refused by key. Every node has its own
    /tmp on a cluster: a multi-node trainer (WORLD_SIZE > LOCAL_WORLD_SIZE) writes a checkpoint that
    no single host holds whole. Where nothing is staged per host either (MF_TMP_IS_NODE_LOCAL=1,
    which the Slurm templates set on the tools/cluster mini-cluster), what the hosts read is refused
    too. ValueError otherwise."""
    multi_node = env.get("WORLD_SIZE", "1") != env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1"))
    keys = [("checkpoint.save_dir", cfg.checkpoint.save_dir)] if multi_node else []
    if env.get("MF_TMP_IS_NODE_LOCAL") == "1":
        keys = [("model.hf_path", cfg.model.hf_path), ("data.path", cfg.data.path),
                ("checkpoint.save_dir", cfg.checkpoint.save_dir), ("logging.dir", cfg.logging.dir)]
    for key, path in keys:
        if path and under_tmp(path):
            raise ValueError(f"{key}={path!r} is under /tmp, which is each host's own here: put it on the shared "
                             "filesystem (outside /tmp)")


def under_tmp(path: str) -> bool:
    real = os.path.realpath(path)
    return real == "/tmp" or real.startswith("/tmp/")


def run(cfg: RunConfig) -> int:
    """Hand the validated config to the controller; torch and Megatron are imported from here on."""
    from megatron_flash.versions import untested

    if _is_local_leader():  # another megatron-core / torch / transformers runs, but says so first
        for line in untested():
            print(line, file=sys.stderr)
    from megatron_flash.controller.assembly import check_loss
    from megatron_flash.trainer.loss_adapter import build_loss

    try:  # the loss, its parameters and its fit to the run's staleness: before any process group exists
        loss = build_loss(cfg.loss)
        check_loss(cfg, loss)
    except ValueError as err:
        if _is_local_leader():
            print(f"config error: loss: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        check_paths(cfg)
        node_local_tmp_paths(cfg)
    except ValueError as err:
        if _is_local_leader():
            print(f"config error: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    from megatron_flash.controller import run as run_controller

    run_controller(cfg, loss=loss)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    if os.environ.get("MF_MEMPROBE"):  # a memory profile of this process (megatron_flash/memprobe.py)
        from megatron_flash.memprobe import start_from_env

        start_from_env()
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        if _is_local_leader():
            print(f"config error: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    if args.print_config:
        if _is_local_leader():
            sys.stdout.write(config_to_yaml(cfg))
        return 0
    if args.print_engine_flags:
        print(shlex.join(engine_flags(cfg, args.print_engine_flags)))
        return 0
    from megatron_flash.hf.hub import resolve_dataset_path, resolve_model_path

    try:  # a Hub id becomes its snapshot directory in the Hugging Face cache, the same on every rank
        cfg.model.hf_path = resolve_model_path(cfg.model.hf_path)
        if cfg.distill.teacher:
            cfg.distill.teacher = resolve_model_path(cfg.distill.teacher, key="distill.teacher")
        cfg.data.path = resolve_dataset_path(cfg.data.path)
        for name, spec in cfg.eval.datasets.items():  # held-out sets may be Hub datasets too
            if spec.get("path"):
                spec["path"] = resolve_dataset_path(spec["path"], key=f"eval.datasets.{name}.path")
    except ValueError as err:
        if _is_local_leader():
            print(f"config error: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
