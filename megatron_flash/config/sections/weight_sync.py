"""Trainer → engine weight updates (`weight_sync`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_flash.config.sections.base import _Section

WEIGHT_TRANSPORTS = ("ipc", "broadcast", "disk")
LORA_SYNC_MODES = ("auto", "merged", "adapter")


@dataclass
class WeightSyncConfig(_Section):
    _section: ClassVar[str] = "weight_sync"

    transport: str = "ipc"
    """Trainer→engine path: ipc (CUDA IPC / shared memory; same node) | broadcast (NCCL/gloo
    group with the engines; any node) | disk (safetensors through the filesystem)."""
    bucket_mb: int = 512
    """Size of one transfer bucket, in MiB."""
    probe: bool = True
    """After each sync, score fixed token sequences teacher-forced on every synced engine and on the
    trainer; the report carries max and mean |Δ logprob| (logged as train_infer_logprob_diff)."""
    probe_threshold: float = 0.05
    """Max mean |Δ logprob| per token the probe tolerates before raising WeightSyncError (fp32 gives
    ~1e-5, bf16 ~1e-2; wrong or partial weights give O(1))."""
    max_resync: int = 1
    """An engine that failed midway (it may hold part of the buckets) and still answers is re-synced
    from scratch up to this many times; 0 = never. Engines that stay failed are taken out of service."""
    timeout_s: float = 600.0
    """Deadline of each weight-sync call to an engine (pause, one bucket, version update, probe); on
    expiry the engine is counted as failed for this sync (re-synced or taken out, as above) and the
    error names the engine, the endpoint and the deadline."""
    fail_fast: bool = False
    """Raise WeightSyncError (naming the engine and the step) when an engine is taken out of service;
    false = carry on with the others and list it in SyncReport.failed_urls. A sync that leaves no
    engine serving the new weights always raises."""
    lora: str = "auto"
    """With model.lora: what a push sends. merged: W + (alpha/r)·B·A formed in float32 and cast once to
    the model dtype, a full-weight push any engine takes; adapter: only the adapter tensors (PEFT
    names, a versioned adapter name), which the local engine merges into its own float32-exact copy
    of the base and SGLang loads through its LoRA API (ipc or disk transport); auto: adapter with
    engines.backend=local (not colocated), merged otherwise. Refused without model.lora."""

    def validate(self) -> None:
        self._one_of("transport", WEIGHT_TRANSPORTS)
        self._one_of("lora", LORA_SYNC_MODES)
        self._at_least("bucket_mb", 1)
        self._positive("probe_threshold")
        self._at_least("max_resync", 0)
        self._positive("timeout_s")
