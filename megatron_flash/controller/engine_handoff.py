"""The trainer ⇄ engines hand-off around each step: with engines.colocate the engines give their
memory back before the trainer computes, and after the optimizer step the new weights go to every
engine (the engines take their memory back inside that push: weights, then the new values, then the KV
cache). Engines restarted since the last push rejoin here and receive every weight; failed engines are
reported to the rollout side so it stops routing to them.

Collective over the trainer ranks (the bridge's transports are); rank 0 alone talks to the rollout
runtime, and what it learns (restarted engines) reaches the other ranks through `broadcast`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from megatron_flash.trace import TRACER, TRAINER

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from megatron_flash.rollout.runtime import RolloutRuntime
    from megatron_flash.weight_sync.bridge import WeightBridge


def sync_metrics(report: Any) -> dict[str, float]:
    """A push's `sync/*` metrics (weight_sync.delta: docs/weight_sync.md "Delta pushes")."""
    out = {"sync/bytes": float(report.bytes_sent), "sync/bytes_full": float(report.bytes_full),
           "sync/seconds": float(report.seconds), "sync/anchor": float(report.anchor),
           "sync/checksum_failures": float(report.checksum_failures), "sync/delta_refused": float(report.delta_refused),
           "sync/encode_seconds": float(report.encode_seconds)}
    if report.delta_density is not None:
        out["sync/delta_density"] = float(report.delta_density)
    if report.delta_copy_bytes:
        out["sync/delta_copy_bytes"] = float(report.delta_copy_bytes)
    return out


class EngineHandoff:
    def __init__(self, bridge: Optional["WeightBridge"], runtime: Optional["RolloutRuntime"], *, rank: int,
                 broadcast: Callable[[Any], Any], fleet: bool = False) -> None:
        self.bridge = bridge
        self.fleet = fleet
        """engines.join_port: engines join and leave between pushes (one more broadcast a push)."""
        self.runtime = runtime if rank == 0 else None
        self.broadcast = broadcast
        self._release_metrics: dict[str, float] = {}
        self._waiting_restarted: Any = ([], [])  # rank 0: engines restarted while the trainer waited
        self._rejoined: dict[str, float] = {}  # their metrics, reported with the next push

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
        out, self._rejoined = self._rejoined, {}
        if self.bridge is not None:
            if self.runtime is not None:
                self._take_restarted()
            restarted, self._waiting_restarted = self._waiting_restarted, ([], [])
            self._readmit(self.broadcast(restarted), out)
            joining = self._fleet_changes()
            report = self._sync(new_version, out, trial=joining)
            out["sync_gb"] = report.bytes_sent / 1e9
            out.update(sync_metrics(report))
            out["engines_out_of_service"] = len(self.bridge.failed)
            out["engines_resynced"] = len(report.resynced_urls)
            if report.mean_abs_logprob_diff is not None:  # the post-sync probe, engine vs trainer
                out["train_infer_logprob_diff"] = float(report.mean_abs_logprob_diff)
                out["train_infer_logprob_diff_max"] = float(report.max_abs_logprob_diff)
                out["time_probe"] = report.probe_seconds
            if self.runtime is not None:
                failed = {u: report.errors.get(u, "failed") for u in report.failed_urls}
                joined = self._settle_joins(joining, report, failed)
                self.runtime.note_sync(new_version, failed, joined=tuple(joined))
                out["engines_joined_now"] = len(joined)
        return out

    def _fleet_changes(self) -> list[str]:
        """engines.join_port: engines that left the fleet since the last push are dropped from the
        bridge, and the ones that registered join this push (whole weights, then the probe). Collective:
        rank 0's registry decides, every rank applies the same lists."""
        if not self.fleet:
            return []
        registry = getattr(self.runtime, "registry", None)
        changes = (registry.take_pending(), registry.take_gone()) if registry is not None else ([], [])
        joining, gone = self.broadcast(changes)
        if gone:
            self.bridge.remove(gone)
        if joining:
            self.bridge.readmit(joining)
        return list(joining)

    def _settle_joins(self, joining: list[str], report: Any, failed: dict[str, str]) -> list[str]:
        """Rank 0: which joining engines serve now; the refused ones leave the bridge (every rank drops
        them at the next push through `take_gone`)."""
        registry = getattr(self.runtime, "registry", None)
        if registry is None or not joining:
            return []
        return registry.settle([u for u in joining if u in report.synced_urls],
                               {u: why for u, why in failed.items() if u in joining})

    def _take_restarted(self) -> None:
        urls, seconds = self.runtime.take_restarted()
        self._waiting_restarted = (self._waiting_restarted[0] + urls, self._waiting_restarted[1] + seconds)

    def wake(self) -> Any:
        """For the batch wait (SampleBuffer.take_batch): `restarted_while_waiting` where the rollout runs in
        this process; None with rollout.runner=process, whose wait runs in the rollout process (a killed
        only engine is then taken back by the push after the batch, if one comes)."""
        return None if self.runtime is None or self.runtime.spawns else self.restarted_while_waiting

    def restarted_while_waiting(self) -> bool:
        """Rank 0, while the trainer waits for a batch: every engine it pushes to has come back since the
        last push (one engine, killed). They hold the checkpoint's weights, so the proxy routes nothing
        to them until they get the trainer's, and no batch can come before that: `rejoin` now. (With
        another engine serving, the batch comes and the next push takes them back.)"""
        if self.runtime is None or self.bridge is None:
            return False
        self._take_restarted()
        back = self._waiting_restarted[0]
        return bool(back) and all(u in back for u in self.bridge.urls)

    def rejoin(self, version: int) -> None:
        """Send the current weights (`version`, unchanged) to the engines `restarted_while_waiting` found,
        and to them only. Collective: every rank, after rank 0's answer was broadcast."""
        restarted = self.broadcast(self._waiting_restarted)
        self._waiting_restarted = ([], [])
        rejoin = restarted[0]
        self._readmit(restarted, self._rejoined)
        report = self._sync(version, self._rejoined, only=rejoin)
        if self.runtime is not None:
            self.runtime.note_sync(version, {u: report.errors.get(u, "failed") for u in report.failed_urls})
        logger.info("engines restarted while the trainer waited for a batch got version %d: %s", version, rejoin)

    def _readmit(self, restarted: Any, out: dict[str, float]) -> None:
        rejoin, restart_s = restarted
        if rejoin:  # restarted engines hold the checkpoint's weights: the next sync sends them everything
            self.bridge.readmit(rejoin)
            out["engines_restarted"] = out.get("engines_restarted", 0) + len(rejoin)
            out["engine_restart_s"] = max(restart_s) if restart_s else float("nan")

    def _sync(self, new_version: int, out: dict[str, float], only: Any = None, trial: Any = ()) -> Any:
        """bridge.sync; when it fails because no engine is left in service and one is coming back (a
        launched engine being restarted, an attached one expected to answer again), wait for it (up to
        engines.down_timeout_s, rank 0) and push again with it readmitted. Collective."""
        from megatron_flash.weight_sync.report import WeightSyncError

        while True:
            try:
                return self.bridge.sync(new_version, only=only, trial=trial)
            except WeightSyncError as error:
                back: Any = ([], [])
                if self.runtime is not None and not self.bridge.fail_fast:
                    logger.warning("%s; waiting for an engine to come back", error)
                    back = self.runtime.wait_restarted(timeout_s=self.runtime.engines_cfg.down_timeout_s)
                back = self.broadcast(back)
                if not back[0]:
                    raise
                self._readmit(back, out)
                only = None if only is None else [*only, *back[0]]

    def release_metrics(self) -> dict[str, float]:
        return dict(self._release_metrics)
