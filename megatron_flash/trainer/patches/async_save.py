"""Patch: megatron-core's distributed-checkpoint save, run by hand.

  replaces   dist_checkpointing.save's synchronous path: we ask for its async request
             (`async_sharded_save=True` → AsyncRequest) and run it here (`execute_sync`), and
             `filesystem_async._results_queue` becomes a thread queue
  why        the synchronous save stages tensors to host memory and then calls
             torch.cuda.synchronize(), which raises on a CPU-only torch; Megatron's results queue is
             made by a multiprocessing Manager (a server process) that a trainer killed with -9
             leaves orphaned; 0.19's default async writer ("nvrx") is a package megatron-core does
             not install, its own ("mcore", 0.16's only one) is asked for where the argument exists;
             and every process forked from here on dies with the trainer (prctl PR_SET_PDEATHSIG):
             a trainer killed mid-save left Megatron's writer processes running for ever
  versions   megatron-core 0.16.1 and 0.19.2 (tested)
  checked    `check()` at start-up (megatron_compat.check): `save` takes async_sharded_save, the
             AsyncRequest has preload_fn, execute_sync and _replace, filesystem_async has
             _results_queue
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch

from megatron_flash.trainer.patches.base import PatchMismatch

_FORK_HOOK = False


def _forked_children_die_with_parent() -> None:
    """Megatron writes checkpoints from processes it forks off the trainer; a trainer killed with -9
    mid-save left them orphaned for ever (found by the resume test). Every child forked from here on
    asks Linux for SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG); a no-op without prctl."""
    global _FORK_HOOK
    if _FORK_HOOK:
        return
    _FORK_HOOK = True

    def in_child() -> None:
        try:
            import ctypes
            import signal

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() == 1:  # the parent died before the signal was armed
            os._exit(1)

    os.register_at_fork(after_in_child=in_child)


def async_strategy_kwargs() -> dict[str, Any]:
    """megatron-core 0.19 asks which async writer to use and defaults to NVIDIA Resiliency Extension's
    ("nvrx", a separate package it does not install); its own ("mcore", which 0.16 always uses, and
    whose request this module runs itself) is what every version has. 0.16 takes no such argument."""
    from megatron.core import dist_checkpointing

    return {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters \
        else {}


def save_dist_checkpoint(sharded_state_dict: dict, path: str) -> None:
    """`dist_checkpointing.save` in torch_dist format, without its CUDA-only staging step.

    Megatron's synchronous save stages tensors to host memory and then calls
    `torch.cuda.synchronize()`, which raises on a CPU-only torch; we ask for the async request
    instead and run it ourselves, without that staging when there is no GPU (a no-op for host
    tensors anyway). Needs psutil (Megatron's writer processes die without it)."""
    import queue

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # Megatron collects write results through a queue it makes with a multiprocessing *Manager* (a
    # server process) on first use; a trainer killed with -9 leaves that process orphaned for ever.
    # execute_sync() runs the write function in this process (its forked writers report through
    # their own queues), so the result goes in and comes out here: a thread queue serves, with no
    # extra process. (A multiprocessing.Queue does not: its put() hands the item to a feeder thread,
    # and Megatron's get_nowait() right after can find it empty — a flaky "results_queue should not
    # be empty" that a resume test hit once.)
    _forked_children_die_with_parent()
    if not isinstance(getattr(filesystem_async, "_results_queue", None), queue.Queue):
        filesystem_async._results_queue = queue.Queue()
    request = dist_checkpointing.save(sharded_state_dict, path, async_sharded_save=True, **async_strategy_kwargs())
    if not torch.cuda.is_available():
        request = request._replace(preload_fn=None)
    request.execute_sync()


def check() -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import async_utils, filesystem_async

    if "async_sharded_save" not in inspect.signature(dist_checkpointing.save).parameters:
        raise PatchMismatch("dist_checkpointing.save", "takes no async_sharded_save (patches/async_save.py runs the "
                            "async request itself)")
    request = getattr(async_utils, "AsyncRequest", None)
    missing = [a for a in ("preload_fn", "execute_sync", "_replace") if not hasattr(request, a)]
    if missing or not hasattr(filesystem_async, "_results_queue"):
        raise PatchMismatch("dist_checkpointing AsyncRequest", f"lacks {missing or ['filesystem_async._results_queue']}")
