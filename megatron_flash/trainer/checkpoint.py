"""Run checkpoints: trainer state per rank + the rollout state, saved atomically, resumed exactly.

Layout under `checkpoint.save_dir`:

    step_000012/                       one complete checkpoint (renamed into place when whole)
        meta.json                      step, policy version, layout — written last
        trainer/rank_00000.pt          this rank's model shard, optimizer, LR schedule, RNG states
        trainer/dist_opt_00000.pt      distributed optimizer: this rank's parameter state (if used)
        rollout.pkl                    rank 0: dataset position, prompts in flight / re-queued,
                                       buffered groups with their versions, staleness counters
    latest                             "step_000012" (atomically replaced after the rename)

A checkpoint is resumed with the same TP × PP × DP layout (the per-rank files are that layout's
shards). Only `keep_last` complete checkpoints are kept. Never load one from an untrusted source:
the files are pickles.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist

LATEST = "latest"


def step_dir(save_dir: str, step: int) -> str:
    return os.path.join(save_dir, f"step_{step:06d}")


def latest_checkpoint(save_dir: str) -> Optional[str]:
    """The directory `latest` names, if it is complete (has meta.json)."""
    try:
        with open(os.path.join(save_dir, LATEST)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    path = os.path.join(save_dir, name)
    return path if os.path.isfile(os.path.join(path, "meta.json")) else None


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        from megatron.core import tensor_parallel

        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    except Exception:  # no tracker initialised (e.g. rollout-only)
        pass
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "tracker" in state:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save(policy: Any, save_dir: str, *, step: int, version: int, rollout_state: Optional[dict[str, Any]],
         keep_last: int = 2, group: Any = None) -> str:
    """Collective over every trainer rank. Returns the checkpoint directory."""
    layout = policy.layout
    final = step_dir(save_dir, step)
    tmp = final + ".tmp"
    if layout.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "trainer"), exist_ok=True)
    dist.barrier(group=group)
    state = {"model": policy.model.state_dict(), "optimizer": policy.optimizer.state_dict(),
             "scheduler": policy.scheduler.state_dict(), "rng": _rng_state(), "step": step, "version": version}
    torch.save(state, os.path.join(tmp, "trainer", f"rank_{layout.rank:05d}.pt"))
    if getattr(policy.settings.optimizer, "use_distributed_optimizer", False):
        policy.optimizer.save_parameter_state(os.path.join(tmp, "trainer", f"dist_opt_{layout.rank:05d}.pt"))
    if layout.rank == 0 and rollout_state is not None:
        with open(os.path.join(tmp, "rollout.pkl"), "wb") as f:
            pickle.dump(rollout_state, f)
    dist.barrier(group=group)
    if layout.rank == 0:
        meta = {"step": step, "version": version, "world_size": layout.world_size, "tp": layout.tp_size,
                "pp": layout.pp_size, "dp": layout.dp_size}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(os.path.join(save_dir, LATEST + ".tmp"), "w") as f:
            f.write(os.path.basename(final))
        os.replace(os.path.join(save_dir, LATEST + ".tmp"), os.path.join(save_dir, LATEST))
        _prune(save_dir, keep_last)
    dist.barrier(group=group)
    return final


def _prune(save_dir: str, keep_last: int) -> None:
    done = sorted(d for d in os.listdir(save_dir) if d.startswith("step_") and not d.endswith(".tmp"))
    for name in done[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    for name in os.listdir(save_dir):  # leftovers of a save that died midway
        if name.endswith(".tmp") and name.startswith("step_"):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


def load(policy: Any, path: str) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """Load this rank's trainer state from checkpoint `path`; returns (meta, rollout_state or None)."""
    layout = policy.layout
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    want = {"world_size": layout.world_size, "tp": layout.tp_size, "pp": layout.pp_size}
    have = {k: meta[k] for k in want}
    if have != want:
        raise ValueError(f"checkpoint {path} was saved with layout {have}; this run has {want} "
                         "(resume with the same parallel layout)")
    state = torch.load(os.path.join(path, "trainer", f"rank_{layout.rank:05d}.pt"), weights_only=False)
    policy.model.load_state_dict(state["model"])
    policy.optimizer.load_state_dict(state["optimizer"])
    if getattr(policy.settings.optimizer, "use_distributed_optimizer", False):
        policy.optimizer.load_parameter_state(os.path.join(path, "trainer", f"dist_opt_{layout.rank:05d}.pt"))
    policy.scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    rollout = None
    if layout.rank == 0 and os.path.isfile(os.path.join(path, "rollout.pkl")):
        with open(os.path.join(path, "rollout.pkl"), "rb") as f:
            rollout = pickle.load(f)
    return meta, rollout
