"""Optimizer and LR schedule (`optimizer`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_flash.config.sections.base import _Section

OPTIMIZERS = ("adam", "sgd")
LR_DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass
class OptimizerConfig(_Section):
    _section: ClassVar[str] = "optimizer"

    name: str = "adam"
    """adam (AdamW-style decoupled weight decay, as Megatron) | sgd."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of linear/cosine decay."""
    weight_decay: float = 0.0
    """Decoupled weight decay coefficient."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.999
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam denominator epsilon."""
    clip_grad: float = 1.0
    """Max global gradient L2 norm; 0 disables clipping."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to lr."""
    lr_decay_style: str = "constant"
    """LR schedule after warm-up: constant|linear|cosine (decay to min_lr at trainer.total_steps)."""
    skip_zero_grad: bool = True
    """Skip the optimizer step (Adam's moments, its step count and weight decay untouched) when the whole
    gradient is exactly zero: every advantage and loss term of the batch was zero, e.g. all replies of
    every group scored alike. The LR schedule and the policy version still advance. Counted as
    train/zero_grad_skipped. false = step anyway (moments decay toward zero on a saturated task, and
    the next real gradient then takes an outsized step; trainer/weight_health.py)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state and master weights over the data-parallel group (Megatron ZeRO-1)."""
    cpu_offload_fraction: float = 0.0
    """Fraction of the optimizer state (and its update) kept in CPU memory, 0 = none (Megatron's
    optimizer_cpu_offload). Needs CUDA (on a CPU trainer everything already is in CPU memory) and
    use_distributed_optimizer."""

    def validate(self) -> None:
        self._one_of("name", OPTIMIZERS)
        self._positive("lr")
        self._at_least("min_lr", 0.0)
        self._require(self.min_lr <= self.lr, "min_lr", f"must be <= optimizer.lr={self.lr}")
        self._at_least("weight_decay", 0.0)
        for name in ("adam_beta1", "adam_beta2"):
            self._require(0.0 <= getattr(self, name) < 1.0, name, "must be in [0, 1)")
        self._positive("adam_eps")
        self._at_least("clip_grad", 0.0)
        self._at_least("lr_warmup_steps", 0)
        self._one_of("lr_decay_style", LR_DECAY_STYLES)
        self._require(0.0 <= self.cpu_offload_fraction <= 1.0, "cpu_offload_fraction", "must be in [0, 1]")
        if self.cpu_offload_fraction > 0:
            self._require(self.use_distributed_optimizer, "cpu_offload_fraction",
                          "needs optimizer.use_distributed_optimizer=true")
