"""Trainer → engine weight updates (`weight_sync`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from megatron_flash.config.sections.base import _Section

WEIGHT_TRANSPORTS = ("ipc", "broadcast", "disk")
LORA_SYNC_MODES = ("auto", "merged", "adapter")
DELTA_MODES = ("off", "on", "auto")


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
    probe_threshold: Optional[float] = None
    """Max mean |Δ logprob| per token the probe tolerates before raising WeightSyncError (fp32 gives
    ~1e-5; wrong or partial weights give O(1)). null = 0.05, or 0.3 when engines.dtype is bfloat16 or
    float16 under a float32 trainer: SmolLM2-135M served in bf16 reads 0.08–0.11 against its fp32
    trainer on the probe's random tokens (docs/benchmarks.md "Delta weight sync across a throttled link")."""
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

    delta: str = "auto"
    """Send only the engine-dtype values that changed since the last push (engines/weight_delta.py: bitwise
    compare against a kept copy, positions + values, per-tensor checksums verified by the engine, full
    pushes to engines not at the base version and every delta_anchor_every-th push). on: every engine
    must take deltas (the local engine does; SGLang does not yet: refused by URL); auto: on with the
    broadcast and disk transports (across hosts, where bytes cost), for the engines that take deltas,
    off with ipc (same node: the copy is as dear as what it saves); off: every push whole. Refused
    with engines.colocate (released weights lose their values) and weight_sync.lora=adapter."""
    delta_anchor_every: int = 20
    """With delta on: every this-many-th push is a full one to every engine (a full anchor); 0 = only
    the first push and engines that (re)join."""
    delta_max_density: float = 0.5
    """With delta on: a tensor with more than this share of its values changed goes whole."""

    def validate(self) -> None:
        self._one_of("transport", WEIGHT_TRANSPORTS)
        # YAML 1.1 (OmegaConf) reads a bare on/off as a boolean, which reaches this str field as "True"/"False"
        self.delta = {"True": "on", "False": "off", True: "on", False: "off"}.get(self.delta, self.delta)
        self._one_of("delta", DELTA_MODES)
        self._at_least("delta_anchor_every", 0)
        self._require(0 < self.delta_max_density <= 1, "delta_max_density", "must be in (0, 1]")
        self._one_of("lora", LORA_SYNC_MODES)
        self._at_least("bucket_mb", 1)
        if self.probe_threshold is not None:
            self._positive("probe_threshold")
        self._at_least("max_resync", 0)
        self._positive("timeout_s")
