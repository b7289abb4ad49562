"""Patch: megatron-core (0.16.1 … 0.19.x) on a CPU-only torch (gloo); nothing when CUDA exists.

  replaces   torch.cuda.current_device; the `torch` name of the Megatron modules in
             _REDIRECT_MODULES (a proxy whose factories map a CUDA device to the CPU);
             tensor_parallel.random's CudaRNGStatesTracker, _get/_set_cuda_rng_state;
             torch.Tensor.type and .cuda (their answers change for callers inside megatron.core only)
  why        the table below: each call would raise on a CPU-only build
  versions   megatron-core 0.16.1 and 0.19.2 (tested), CPU only (`apply()` returns at once with CUDA)
  checked    `check()` at start-up on CPU: tensor_parallel.random has what is replaced, and
             initialize_rng_tracker takes force_reset

Megatron-Core assumes CUDA in a handful of places that our CPU path reaches. Each patch below turns
a call that would *raise* on a CPU-only build into the CPU equivalent, so code that already works is
never changed, and `apply()` returns early when `torch.cuda.is_available()`:

  what megatron does                                   patch (CPU only)
  ---------------------------------------------------  -----------------------------------------------
  torch.cuda.current_device() (rotary, optimizers)     returns torch.device("cpu")
  torch.zeros(..., device="cuda") in a module list     that module's `torch` becomes a proxy whose
    (schedules, clip_grads, optimizer, utils, ...)       factory functions map a CUDA device to "cpu"
  torch.cuda.current_stream() / Stream / stream(...)   the same proxy's `torch.cuda` answers with
    (0.19's grad buffers wait on CUDA-graph events)      torch.cpu's stream and event (no-ops)
  CudaRNGStatesTracker (torch.cuda.get_rng_state)      a tracker over the CPU generator's state
  tensor.type() == "torch.cuda.FloatTensor" checks     Tensor.type() answers the CUDA name to callers
    (clip_grads, distributed optimizer, fp16 optim)      inside megatron.core only
  weight.data.cuda() (tied embeddings with PP > 1)     Tensor.cuda() is a no-op for megatron.core callers
  batched P2P with a CUDA sync                         callers set batch_p2p_comm/sync False (see
                                                         model_builder), not patched here
  CUDA RNG save/restore around activation recompute    the CPU generator's state

Not supported on CPU (and not patched): fused kernels. Sequence parallel needs no patch (gloo has
reduce_scatter_tensor and all_gather_into_tensor).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import types
from typing import Any, Iterator

import torch

_APPLIED = False

# Modules whose `torch.<factory>(..., device="cuda")` calls we redirect. Only modules on the
# train/logprob path; adding one here is the whole cost of supporting a new call site.
_REDIRECT_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.tensor_parallel.data",
    "megatron.core.transformer.utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.utils",
)
_FACTORIES = frozenset(
    {"zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like",
     "empty_like", "full_like", "rand", "randn", "randint", "as_tensor"}
)


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int):
        return True  # a bare int means a CUDA ordinal to torch
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _cpu_factory(fn: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    wrapped.__name__ = getattr(fn, "__name__", "factory")
    return wrapped


class _CpuCudaProxy(types.ModuleType):
    """Stands in for `torch.cuda` inside one megatron module: streams and events are torch.cpu's
    (no-ops that keep the calling code's shape), the rest forwards to the real torch.cuda."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")
        self._cpu = {
            "current_stream": lambda *args, **kwargs: torch.cpu.current_stream(),
            "default_stream": lambda *args, **kwargs: torch.cpu.current_stream(),
            "Stream": lambda *args, **kwargs: torch.cpu.Stream(),
            "Event": lambda *args, **kwargs: torch.cpu.Event(),
            "stream": torch.cpu.stream,
            "synchronize": lambda *args, **kwargs: None,
            "current_device": lambda: torch.device("cpu"),
        }

    def __getattr__(self, name: str) -> Any:
        cpu = self.__dict__.get("_cpu", {})
        if name in cpu:
            return cpu[name]
        return getattr(torch.cuda, name)


class _CpuTorchProxy(types.ModuleType):
    """Stands in for `torch` inside one megatron module; everything forwards to the real torch."""

    def __init__(self) -> None:
        super().__init__("torch")
        self._wrapped = {name: _cpu_factory(getattr(torch, name)) for name in _FACTORIES}
        self._wrapped["cuda"] = _CpuCudaProxy()

    def __getattr__(self, name: str) -> Any:
        wrapped = self.__dict__.get("_wrapped", {})
        if name in wrapped:
            return wrapped[name]
        return getattr(torch, name)


class CpuRNGStatesTracker:
    """Megatron's RNG-tracker interface over the CPU default generator.

    `fork(name)` swaps the named state in, runs the block, stores the advanced state and restores
    the caller's, exactly as the CUDA tracker does with the CUDA generator.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _called_from_megatron() -> bool:
    frame = sys._getframe(2)
    return frame.f_globals.get("__name__", "").startswith("megatron.core")


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def apply() -> bool:
    """Install the CPU patches once. Returns True if patches are active, False when CUDA exists."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]

    proxy = _CpuTorchProxy()
    for name in _REDIRECT_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue  # optional module absent in this megatron-core version
        if getattr(module, "torch", None) is torch:
            module.torch = proxy

    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker  # type: ignore[misc]
    mrandom.initialize_rng_tracker(force_reset=True)
    # Activation recompute saves and restores the "CUDA" generator around the re-run forward.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)

    original_type = torch.Tensor.type
    original_cuda = torch.Tensor.cuda

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and _called_from_megatron():
            return _CUDA_TYPE_NAMES.get(self.dtype, original_type(self))
        return original_type(self, *args, **kwargs)

    def cuda_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _called_from_megatron():
            return self
        return original_cuda(self, *args, **kwargs)

    torch.Tensor.type = type_  # type: ignore[method-assign]
    torch.Tensor.cuda = cuda_  # type: ignore[method-assign]
    _APPLIED = True
    return True


def check() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    from megatron_flash.trainer.patches.base import PatchMismatch

    missing = [name for name in ("CudaRNGStatesTracker", "initialize_rng_tracker", "_get_cuda_rng_state",
                                 "_set_cuda_rng_state") if not hasattr(mrandom, name)]
    if missing:
        raise PatchMismatch("tensor_parallel.random", f"has no {missing}; trainer/patches/cpu.py replaces them on CPU")
    if "force_reset" not in inspect.signature(mrandom.initialize_rng_tracker).parameters:
        raise PatchMismatch("tensor_parallel.random.initialize_rng_tracker",
                            "takes no force_reset (patches/cpu.py passes it)")
