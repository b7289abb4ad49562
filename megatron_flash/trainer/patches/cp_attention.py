"""Patch: the local layer spec's core attention built under context parallelism.

  replaces   nothing in place: our core attentions (packed_attention.py, flash_attention.py) call
             DotProductAttention.__init__ with a shallow copy of the TransformerConfig whose
             context_parallel_size is 1, then keep the real config
  why        DotProductAttention.__init__ asserts context_parallel_size == 1 ("only supported by
             TEDotProductAttention"): its own forward has no CP. Ours does (the plan of
             trainer/context_parallel.py over K/V all-gathered over the CP group), and nothing else
             of __init__ reads the CP size
  versions   megatron-core 0.16.1 and 0.19.2 (tested)
  checked    `check()` at start-up: DotProductAttention.__init__ takes the config first and reads
             context_parallel_size only in that assertion
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

from megatron_flash.trainer.patches.base import PatchMismatch


def init_config(config: Any) -> Any:
    """The config DotProductAttention.__init__ gets: `config` itself without CP, else a copy at CP 1."""
    if getattr(config, "context_parallel_size", 1) == 1:
        return config
    quiet = copy.copy(config)  # dataclasses.replace would rerun TransformerConfig's validation
    quiet.context_parallel_size = 1
    return quiet


def check() -> None:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    params = list(inspect.signature(DotProductAttention.__init__).parameters)
    if params[1:2] != ["config"]:
        raise PatchMismatch("DotProductAttention.__init__", f"takes {params[1:3]} first; patches/cp_attention.py "
                            "passes the config first")
    uses = inspect.getsource(DotProductAttention.__init__).count("context_parallel_size")
    if uses != 1:
        raise PatchMismatch("DotProductAttention.__init__", f"reads context_parallel_size {uses} times; "
                            "patches/cp_attention.py builds it at CP 1 assuming only its assertion does")
