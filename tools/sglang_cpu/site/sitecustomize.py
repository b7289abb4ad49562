"""Process-wide setup for SGLang server processes started by tools/sglang_cpu/launch.sh.

launch.sh puts this folder on PYTHONPATH, so Python imports this module at start-up in the server
process AND in every child it spawns (the scheduler and detokenizer are started with the
multiprocessing "spawn" method and inherit the environment, so each one runs this again).

It sets torch's tensor-sharing strategy to "file_system" (override with
MF_SGLANG_SHARING_STRATEGY). Tensors that cross a process boundary inside the server — and the
ones a client hands over with /update_weights_from_tensor, which the client must also pickle with
the "file_system" strategy — then travel as named shared-memory files instead of file descriptors
passed over a socket (the default "file_descriptor" strategy, which breaks here).
"""

import os

_strategy = os.environ.get("MF_SGLANG_SHARING_STRATEGY", "file_system")
if _strategy:
    try:
        import torch.multiprocessing as _tmp

        _tmp.set_sharing_strategy(_strategy)
    except Exception as _e:  # never break interpreter start-up
        import sys

        print(f"[sglang_cpu sitecustomize] could not set sharing strategy: {_e!r}", file=sys.stderr)

# SGLang 0.5.23's LoRA layers and its torch_native LoRA backend ask for pinned host memory
# unconditionally (`pin_memory=True` in torch.tensor / torch.zeros / torch.empty, `.pin_memory()`),
# which a CPU-only torch refuses ("pin_memory=True requires a CUDA or other accelerator backend"), so
# `--enable-lora` cannot start on CPU. Pinning only speeds host-to-device copies; with no device there
# is nothing to pin, so here it is a no-op (MF_SGLANG_CPU_PIN_NOOP=0 keeps SGLang's behaviour).
if os.environ.get("MF_SGLANG_CPU_PIN_NOOP", "1") == "1":
    try:
        import functools as _functools

        import torch as _torch

        if not _torch.cuda.is_available():
            def _unpinned(factory):
                @_functools.wraps(factory)
                def make(*args, **kwargs):
                    kwargs.pop("pin_memory", None)
                    return factory(*args, **kwargs)
                return make

            for _name in ("tensor", "empty", "zeros", "ones", "full", "arange"):
                setattr(_torch, _name, _unpinned(getattr(_torch, _name)))
            _torch.Tensor.pin_memory = lambda self, *a, **k: self
    except Exception as _e:  # never break interpreter start-up
        import sys

        print(f"[sglang_cpu sitecustomize] could not make pin_memory a no-op: {_e!r}", file=sys.stderr)
