"""Checkpoint orchestration for the controller's loop: resume at start-up, saves every N steps and on
SIGTERM (collective over the trainer ranks), HF exports (every N steps, at the end, and of what
training reached when a run stops on an error), and the trained-prompt ledger that a resume cuts back
to the checkpoint's step.

The loop decides *when* (after each step's push); this module owns *how*: the order of the HF export
and the Megatron checkpoint, the SIGTERM flag and its all-reduce, where each export lands.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from megatron_flash.trace import TRACER, TRAINER

if TYPE_CHECKING:
    from megatron_flash.config.schema import CheckpointConfig
    from megatron_flash.trainer.policy import MegatronPolicy

logger = logging.getLogger(__name__)

LEDGER = "trained_prompts.jsonl"  # one line per step: which prompts it trained
_SIGTERM: dict[str, Any] = {"seen": False, "at": 0.0}


class Checkpoints:
    """Saves and restores one run's policy (and, on rank 0, its rollout state)."""

    def __init__(self, cfg: "CheckpointConfig", *, policy: Optional["MegatronPolicy"], run_dir: str, rank: int,
                 ctrl_group: Any, mode: Any) -> None:
        self.cfg = cfg
        self.policy = policy
        self.run_dir = run_dir
        self.rank = rank
        self.ctrl_group = ctrl_group
        self.mode = mode

    def resume(self) -> Optional[tuple[dict[str, Any], Any]]:
        """(meta, rollout state) of the latest checkpoint under checkpoint.save_dir, or None. Loads the
        policy and cuts the ledger back to the checkpoint's step (those steps will be trained again)."""
        from megatron_flash.trainer import checkpoint as ckpt

        c = self.cfg
        path = ckpt.latest_checkpoint(c.save_dir) if c.resume else None
        if path is None:
            if self.rank == 0 and c.resume:
                logger.info("checkpoint.resume: no checkpoint under %s yet; starting fresh", c.save_dir)
            return None
        meta, rollout = ckpt.load(self.policy, path)
        if self.rank == 0:
            truncate_ledger(os.path.join(self.run_dir, LEDGER), keep_through=meta["step"])
            logger.info("resumed from %s: step %d done, policy version %d", path, meta["step"], meta["version"])
        return meta, rollout

    def maybe_save(self, step: int, *, version: int, rollout_state: Any) -> bool:
        """Save every checkpoint.save_interval steps, and when SIGTERM arrived on any rank (then
        returns True: the run stops after saving). Collective over the trainer ranks.
        `rollout_state` is called on rank 0 only when a save is due."""
        c = self.cfg
        stop = _SIGTERM["seen"]
        if self.ctrl_group is not None:
            flag = torch.tensor([1 if stop else 0])
            dist.all_reduce(flag, group=self.ctrl_group)
            stop = bool(flag.item())
        if c.save_hf_interval > 0 and (step + 1) % c.save_hf_interval == 0 and self.mode.trains:
            # Before the Megatron checkpoint: a run killed during the export resumes from the step
            # before and exports this step again (a half-written export never has a checkpoint after it).
            self.export_hf(step)
        due = c.save_interval > 0 and (step + 1) % c.save_interval == 0
        if (due or stop) and c.save_dir and self.mode.checkpoints:
            from megatron_flash.trainer import checkpoint as ckpt

            t0 = time.monotonic()
            with TRACER.span("checkpoint", "checkpoint", TRAINER, step=step, version=version):
                rollout = rollout_state() if self.rank == 0 else None
                path = ckpt.save(self.policy, c.save_dir, step=step, version=version, rollout_state=rollout,
                                 group=self.ctrl_group)
            if self.rank == 0:
                logger.info("checkpoint %s (%.2f s)%s", path, time.monotonic() - t0,
                            "; stopping on SIGTERM" if stop else "")
        return stop

    def last_good(self) -> str:
        """The newest complete checkpoint (Megatron, HF export) this run can go back to, for an error
        that leaves the current weights unusable; else the start checkpoint."""
        from megatron_flash.trainer import checkpoint as ckpt

        found = []
        if self.cfg.save_dir and ckpt.latest_checkpoint(self.cfg.save_dir):
            found.append(f"{ckpt.latest_checkpoint(self.cfg.save_dir)} (checkpoint.resume=true resumes it)")
        if os.path.isdir(os.path.join(self.hf_dir(), "latest")):
            found.append(f"HF export {os.path.realpath(os.path.join(self.hf_dir(), 'latest'))}")
        return "; ".join(found) or "none saved by this run (it started from model.hf_path)"

    def hf_dir(self) -> str:
        return os.path.join(self.cfg.save_dir or self.run_dir, "hf")

    def export_hf(self, step: int) -> str:
        """HF checkpoint of the weights after `step` (collective), then hf/latest → it (rank 0)."""
        from megatron_flash.hf.io import point_latest

        t0 = time.monotonic()
        name = f"step_{step + 1:06d}"
        out = os.path.join(self.hf_dir(), name)
        with TRACER.span("hf export", "checkpoint", TRAINER, step=step):
            self.policy.export_hf(out)
        if self.rank == 0:
            point_latest(self.hf_dir(), name)
            logger.info("HF checkpoint %s (%.2f s)", out, time.monotonic() - t0)
        return out

    def save_at_end(self, error: Optional[BaseException], *, weights_version: int, every_rank_stopped: bool) -> None:
        """After the loop: the final HF checkpoint of a run that ended well; after an error, what
        training reached (`weights_version`), when it is safe — every rank stopped together (the
        export is collective) or there is one rank."""
        if self.policy is None:
            return
        if error is None:
            if self.cfg.save_hf_at_end:
                out = os.path.join(self.cfg.save_dir or self.run_dir, "final_hf")
                with TRACER.span("final hf export", "checkpoint", TRAINER):
                    self.policy.export_hf(out)
                if self.rank == 0:
                    logger.info("final HF checkpoint: %s", out)
            return
        if not (every_rank_stopped or (isinstance(error, Exception) and self.policy.layout.world_size == 1)):
            return
        out = os.path.join(self.run_dir, f"hf_at_stop_v{weights_version}")
        try:
            self.policy.export_hf(out)
        except Exception as e:  # e.g. the disk that failed the checkpoint: the first error is the one to report
            shutil.rmtree(out + ".partial", ignore_errors=True)
            logger.error("%s; policy version %d could not be saved to %s either: %s", error, weights_version, out, e)
        else:
            if self.rank == 0:
                logger.error("%s; policy version %d saved to %s", error, weights_version, out)


def install_sigterm_flag() -> None:
    """SIGTERM (Slurm pre-emption, torchrun stopping) → save at the end of this step and stop."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        now = time.monotonic()
        if _SIGTERM["seen"] and now - _SIGTERM["at"] < 10.0:
            # scancel signals every process of the job and torchrun forwards its own copy: one event.
            return
        if _SIGTERM["seen"] and callable(previous):  # a later SIGTERM: stop now (engines too)
            previous(signum, frame)
            return
        if _SIGTERM["seen"]:
            raise SystemExit(128 + signum)
        _SIGTERM["seen"], _SIGTERM["at"] = True, now
        logger.warning("SIGTERM: checkpointing at the end of this step, then stopping (again after 10 s "
                       "to stop now)")

    signal.signal(signal.SIGTERM, handler)


def truncate_ledger(path: str, *, keep_through: int) -> None:
    """Drop ledger lines of steps after the checkpoint (they will be trained again)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        keep = [line for line in f if line.strip() and json.loads(line)["step"] <= keep_through]
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)
