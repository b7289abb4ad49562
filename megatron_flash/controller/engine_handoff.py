"""The trainer ⇄ engines hand-off around each step: with engines.colocate the engines give their
memory back before the trainer computes, and after the optimizer step the new weights go to every
engine (the engines take their memory back inside that push: weights, then the new values, then the KV
cache). Engines restarted since the last push rejoin here and receive every weight; failed engines are
reported to the rollout side so it stops routing to them.

Collective over the trainer ranks (the bridge's transports are); rank 0 alone talks to the rollout
runtime, and what it learns (restarted engines) reaches the other ranks through `broadcast`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from megatron_flash.trace import TRACER, TRAINER

if TYPE_CHECKING:
    from megatron_flash.rollout.runtime import RolloutRuntime
    from megatron_flash.weight_sync.bridge import WeightBridge


class EngineHandoff:
    def __init__(self, bridge: Optional["WeightBridge"], runtime: Optional["RolloutRuntime"], *, rank: int,
                 broadcast: Callable[[Any], Any]) -> None:
        self.bridge = bridge
        self.runtime = runtime if rank == 0 else None
        self.broadcast = broadcast
        self._release_metrics: dict[str, float] = {}

    def release(self, version: int) -> None:
        """engines.colocate: engines free their memory for the trainer's step (no-op otherwise)."""
        self._release_metrics = {}
        if self.bridge is None or self.bridge.memory is None:
            return
        t0 = time.monotonic()
        with TRACER.span("release engines", "sync", TRAINER):
            errors = self.bridge.release_memory()
        if errors and self.runtime is not None:
            self.runtime.note_sync(version, errors)
        self._release_metrics = {"time_release": time.monotonic() - t0}

    def push(self, new_version: int) -> dict[str, float]:
        """Send the weights of `new_version` to every engine; the step's sync metrics (and the
        release's, when it ran). Without a bridge (train_only, rollout_only) only the time is kept."""
        out: dict[str, float] = {}
        if self.bridge is not None:
            restarted: Any = ([], [])
            if self.runtime is not None:
                restarted = self.runtime.take_restarted()
            rejoin, restart_s = self.broadcast(restarted)
            if rejoin:  # restarted engines hold the checkpoint's weights: this sync sends them everything
                self.bridge.readmit(rejoin)
                out["engines_restarted"] = len(rejoin)
                out["engine_restart_s"] = max(restart_s) if restart_s else float("nan")
            report = self.bridge.sync(new_version)
            out["sync_gb"] = report.bytes_sent / 1e9
            out["engines_out_of_service"] = len(self.bridge.failed)
            out["engines_resynced"] = len(report.resynced_urls)
            if report.mean_abs_logprob_diff is not None:  # the post-sync probe, engine vs trainer
                out["train_infer_logprob_diff"] = float(report.mean_abs_logprob_diff)
                out["train_infer_logprob_diff_max"] = float(report.max_abs_logprob_diff)
                out["time_probe"] = report.probe_seconds
            if self.runtime is not None:
                self.runtime.note_sync(new_version, {u: report.errors.get(u, "failed") for u in report.failed_urls})
        return out

    def release_metrics(self) -> dict[str, float]:
        return dict(self._release_metrics)
