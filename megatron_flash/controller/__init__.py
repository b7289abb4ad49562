"""The controller: the asynchronous RL loop (loop.py, with the dataflow picture) and what it delegates —
building components (assembly.py), checkpoints and resume (checkpoints.py), the engines' hand-off around
each step (engine_handoff.py), and each step's metrics row (step_metrics.py)."""

from megatron_flash.controller.loop import Controller, RolloutStopped, run

__all__ = ["Controller", "RolloutStopped", "run"]
