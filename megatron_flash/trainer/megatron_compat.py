"""Megatron-Core internals the trainer replaces or wraps, checked once before the model is built.

Megatron has no extension point for four things the trainer needs, so it replaces them in place:

  what                                              where           why
  ------------------------------------------------  --------------  -----------------------------------
  rope_utils._apply_rotary_pos_emb_thd              trainer/rope.py  packed rows' RoPE without a host
                                                                     sync per sample
  DistributedOptimizer._set_main_param_and_         checkpoint.py    0.16's reshardable load copies a
    optimizer_states(model_param, tensors)                           `step` it never read (KeyError)
  dist_checkpointing.save(async_sharded_save=True)  checkpoint.py    the async request run here, without
    → AsyncRequest (preload_fn, execute_sync)                        its CUDA staging on CPU; 0.19's
    (+ async_strategy="mcore" where it exists)                       default writer (nvrx) is a package
                                                                     megatron-core does not install
  tensor_parallel.random: CudaRNGStatesTracker,     cpu_shim.py      the CPU generator stands in for
    initialize_rng_tracker, _get/_set_cuda_rng_state  (CPU only)     CUDA's

A replacement written against one version's signature fails in the first step of another (the
first 0.19 run failed so: `apply_rotary_pos_emb_thd() got an unexpected keyword argument
'mla_rotary_interleaved'`). `check()` reads each target's signature now and raises one RuntimeError
line naming the megatron-core version, the target and what differs — at start-up, never mid-run.
"""

from __future__ import annotations

import inspect
from typing import Any, List

from megatron_flash.versions import TESTED, installed


def version() -> str:
    return installed("megatron-core") or "unknown"


def _fail(what: str, detail: str) -> RuntimeError:
    return RuntimeError(f"megatron-core {version()} (tested: megatron-core{TESTED['megatron-core']}): {what}: {detail}")


def _params(fn: Any) -> List[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def check_optimizer_load() -> None:
    from megatron.core.optimizer import distrib_optimizer

    cls = getattr(distrib_optimizer, "DistributedOptimizer", None)
    fn = getattr(cls, "_set_main_param_and_optimizer_states", None)
    if fn is None:
        raise _fail("DistributedOptimizer._set_main_param_and_optimizer_states",
                    "missing; trainer/checkpoint.py wraps it on a reshardable load")
    if _params(fn) != ["model_param", "tensors"]:
        raise _fail("DistributedOptimizer._set_main_param_and_optimizer_states",
                    f"takes {_params(fn)}, trainer/checkpoint.py wraps (model_param, tensors)")


def check_checkpoint_save() -> None:
    """checkpoint.save_dist_checkpoint asks for an async request and runs it itself."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import async_utils, filesystem_async

    params = inspect.signature(dist_checkpointing.save).parameters
    if "async_sharded_save" not in params:
        raise _fail("dist_checkpointing.save", "takes no async_sharded_save (trainer/checkpoint.py runs the "
                    "async request itself)")
    request = getattr(async_utils, "AsyncRequest", None)
    missing = [a for a in ("preload_fn", "execute_sync", "_replace") if not hasattr(request, a)]
    if missing or not hasattr(filesystem_async, "_results_queue"):
        raise _fail("dist_checkpointing AsyncRequest", f"lacks {missing or ['filesystem_async._results_queue']}")


def check_cpu_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    missing = [name for name in ("CudaRNGStatesTracker", "initialize_rng_tracker", "_get_cuda_rng_state",
                                 "_set_cuda_rng_state") if not hasattr(mrandom, name)]
    if missing:
        raise _fail("tensor_parallel.random", f"has no {missing}; trainer/cpu_shim.py replaces them on CPU")
    if "force_reset" not in inspect.signature(mrandom.initialize_rng_tracker).parameters:
        raise _fail("tensor_parallel.random.initialize_rng_tracker", "takes no force_reset (cpu_shim.py passes it)")


def check(*, cpu: bool) -> None:
    """Every replaced internal matches what its replacement was written for (RuntimeError otherwise)."""
    from megatron_flash.trainer import rope

    rope.check_signatures()  # its error names the version and the span too
    check_optimizer_load()
    check_checkpoint_save()
    if cpu:
        check_cpu_rng()
