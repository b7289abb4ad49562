"""Checkpointing and the final export (`checkpoint`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_flash.config.sections.base import _Section


@dataclass
class CheckpointConfig(_Section):
    _section: ClassVar[str] = "checkpoint"

    save_dir: str = ""
    """Directory for Megatron (distributed) checkpoints; empty = no checkpoints."""
    save_interval: int = 0
    """Save every this many optimizer steps; 0 = never during training."""
    resume: bool = False
    """Resume from the latest checkpoint in save_dir (model, optimizer, policy version, data order)."""
    save_hf_at_end: bool = True
    """Export HF safetensors at the end (under save_dir, else logging.dir)."""
    save_hf_interval: int = 0
    """Export an HF checkpoint every this many steps to {save_dir, else logging.dir}/hf/step_NNNNNN
    (atomically) and point the symlink hf/latest at it; 0 = never."""

    def validate(self) -> None:
        self._at_least("save_interval", 0)
        self._at_least("save_hf_interval", 0)
        if self.save_interval > 0:
            self._require(bool(self.save_dir), "save_dir", "must be set when checkpoint.save_interval > 0")
        if self.resume:
            self._require(bool(self.save_dir), "save_dir", "must be set when checkpoint.resume=true")
