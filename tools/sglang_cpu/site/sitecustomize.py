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
