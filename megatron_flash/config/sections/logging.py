"""Metrics and the run directory (`logging`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_flash.config.sections.base import _Section

WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class LoggingConfig(_Section):
    _section: ClassVar[str] = "logging"

    dir: str = "runs/default"
    """Run directory: resolved config, metrics, TensorBoard and W&B files."""
    wandb_mode: str = "offline"
    """offline (files under dir, sync later) | online | disabled."""
    wandb_project: str = "megatron-flash"
    """W&B project name."""
    tensorboard: bool = True
    """Also write TensorBoard event files under dir."""
    log_interval: int = 1
    """Log metrics every this many optimizer steps."""
    trace: bool = False
    """Write the run's timeline to dir/trace.json (Chrome trace-event format: Perfetto, chrome://tracing):
    trainer rank 0's stages, the weight push's phases, every engine request, rewards, buffer admission
    and drops, env steps (megatron_flash/trace.py). Off: nothing is recorded."""
    trace_rotate_steps: int = 100
    """With trace: each file covers this many steps (trace.json, then trace.1.json, ...), so each stays
    bounded on a long run."""

    def validate(self) -> None:
        self._require(bool(self.dir), "dir", "must be a non-empty directory")
        self._one_of("wandb_mode", WANDB_MODES)
        self._at_least("log_interval", 1)
        self._at_least("trace_rotate_steps", 1)
        self._require(self.trace or self.trace_rotate_steps == 100, "trace_rotate_steps",
                      "takes effect only with logging.trace=true")
