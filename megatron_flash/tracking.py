"""Run tracking: one `Tracker.log(step, metrics)` call per optimizer step fans out to

    {run_dir}/metrics.jsonl     every step, one JSON object per line ("step" first; NaN/inf → null)
    {run_dir}/tensorboard/      scalars, every log_interval steps        (logging.tensorboard)
    W&B                         wandb.log, every log_interval steps      (logging.wandb_mode)
    console                     a tqdm bar over total_steps; its postfix shows reward_mean,
                                staleness_mean and tokens_per_s when present
    {run_dir}/trace.json        the run's timeline, written after each step   (logging.trace;
                                trace.py: rotated every logging.trace_rotate_steps steps)

Only rank 0 writes; on other ranks every method is a no-op. Logging never stops a training run:
a missing `tensorboard` package or a W&B init failure (e.g. `online` without network or API key)
prints one warning naming the config key and that sink is switched off. metrics.jsonl is the
record that always exists; it is line-buffered (flushed per line, not fsynced), so a crashed run
keeps every step it logged.

    with Tracker(cfg.logging.dir, cfg.logging, total_steps=100, config=cfg_dict) as tracker:
        for step in range(1, 101):
            tracker.log(step, {"loss": loss, "reward_mean": r})
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from typing import Any, Mapping, Optional

from megatron_flash.trace import TRACER

logger = logging.getLogger(__name__)

# Shown in the progress bar's postfix when present (matched on the last "/"-separated part of the key).
CONSOLE_KEYS = ("reward_mean", "staleness_mean", "tokens_per_s")

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def _scalar(name: str, value: Any) -> Optional[float | int]:
    """A JSON-safe scalar: ints stay ints, everything else becomes a float; NaN/inf and
    unconvertible values become None (the latter with a warning: a caller bug, not worth a crash)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    try:
        number = float(value)  # python/numpy/0-d torch scalars
    except (TypeError, ValueError):
        _warn_once(f"value:{name}", f"metric {name!r} is not a number ({type(value).__name__}); logged as null")
        return None
    return number if math.isfinite(number) else None


class Tracker:
    """Metrics sinks of one run (see the module docstring). Use as a context manager or call `close()`."""

    def __init__(self, run_dir: str, logging_cfg: Any, *, total_steps: int, config: Optional[dict] = None,
                 rank: int = 0) -> None:
        self.run_dir = run_dir
        self.log_interval = max(1, int(logging_cfg.log_interval))
        self.total_steps = total_steps
        self.active = rank == 0
        self._closed = False
        self._jsonl = None
        self._tensorboard = None
        self._wandb_run = None
        self._bar = None
        self._tracing = False
        if not self.active:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8", buffering=1)
        if logging_cfg.tensorboard:
            self._tensorboard = self._open_tensorboard()
        if logging_cfg.wandb_mode != "disabled":
            self._wandb_run = self._open_wandb(logging_cfg.wandb_project, logging_cfg.wandb_mode, config)
        if logging_cfg.trace:
            TRACER.start(run_dir, rotate_steps=logging_cfg.trace_rotate_steps)
            self._tracing = True
        from tqdm import tqdm

        self._bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)

    # ------------------------------------------------------------------ sinks
    def _open_tensorboard(self) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            _warn_once("tensorboard", f"logging.tensorboard=true but TensorBoard is unavailable ({error}); continuing "
                                      "without it (pip install tensorboard, or set logging.tensorboard=false)")
            return None
        return SummaryWriter(log_dir=os.path.join(self.run_dir, "tensorboard"))

    def _open_wandb(self, project: str, mode: str, config: Optional[dict]) -> Any:
        try:
            import wandb

            return wandb.init(project=project, dir=self.run_dir, mode=mode, config=config)
        except Exception as error:  # wandb raises many types (UsageError, CommError, timeouts)
            _warn_once("wandb", f"logging.wandb_mode={mode}: W&B init failed ({type(error).__name__}: {error}); "
                                "continuing with W&B disabled (set logging.wandb_mode=offline or disabled)")
            return None

    # ------------------------------------------------------------------ logging
    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.active or self._closed:
            return
        if "step" in metrics:
            raise ValueError("metrics must not contain the key 'step' (it is the log call's own argument)")
        clean = {name: _scalar(name, value) for name, value in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, **clean}, allow_nan=False) + "\n")
        if self._tracing:
            TRACER.step_done(step)
        self._advance_bar(step)
        if step % self.log_interval != 0 and step != self.total_steps:
            return
        finite = {name: value for name, value in clean.items() if value is not None}
        self._to_sinks(step, finite)
        if self._bar is not None:
            shown = {name.rsplit("/", 1)[-1]: value for name, value in finite.items()
                     if name.rsplit("/", 1)[-1] in CONSOLE_KEYS}
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=True)

    def log_side(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Metrics recorded in their own file by the caller (evaluation): TensorBoard and W&B only."""
        if not self.active or self._closed:
            return
        self._to_sinks(step, {name: v for name, v in ((n, _scalar(n, x)) for n, x in metrics.items()) if v is not None})

    def _to_sinks(self, step: int, finite: Mapping[str, float]) -> None:
        """Scalars to TensorBoard and W&B (a W&B failure disables W&B with one warning)."""
        if self._tensorboard is not None:
            for name, value in finite.items():
                self._tensorboard.add_scalar(name, value, global_step=step)
            self._tensorboard.flush()
        if self._wandb_run is not None:
            self._wandb_log(dict(finite), step)

    def _wandb_log(self, payload: dict, step: int) -> None:
        try:
            self._wandb_run.log(payload, step=step)
        except Exception as error:
            _warn_once("wandb.log", f"W&B log failed ({type(error).__name__}: {error}); "
                                    "continuing with W&B disabled (logging.wandb_mode)")
            self._wandb_run = None

    def log_histograms(self, step: int, values: Mapping[str, Any]) -> None:
        """Distributions (name → 1-D tensor or list of floats) to TensorBoard and W&B on logged steps;
        metrics.jsonl keeps scalars only."""
        if not self.active or self._closed or (step % self.log_interval != 0 and step != self.total_steps):
            return
        import torch

        values = {n: torch.as_tensor(v, dtype=torch.float32).flatten() for n, v in values.items()}
        values = {n: v[torch.isfinite(v)] for n, v in values.items()}
        values = {n: v for n, v in values.items() if v.numel()}
        if self._tensorboard is not None and values:
            for name, v in values.items():
                self._tensorboard.add_histogram(name, v, global_step=step)
            self._tensorboard.flush()
        if self._wandb_run is not None and values:
            import wandb

            self._wandb_log({n: wandb.Histogram(v.numpy()) for n, v in values.items()}, step)

    def _advance_bar(self, step: int) -> None:
        if self._bar is not None and step > self._bar.n:
            self._bar.update(step - self._bar.n)

    # ------------------------------------------------------------------ lifecycle
    def close(self, *, failed: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tracing:
            TRACER.stop()
        if self._bar is not None:
            self._bar.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb_run is not None:
            try:
                self._wandb_run.finish(exit_code=1 if failed else 0)
            except Exception as error:
                _warn_once("wandb.finish", f"W&B finish failed ({type(error).__name__}: {error})")
        if self._jsonl is not None:
            self._jsonl.close()

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(failed=exc_type is not None)
