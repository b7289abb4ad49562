"""Patch: megatron-core's `moe_utils.te_general_gemm` where Transformer Engine is absent.

  replaces   megatron.core.transformer.moe.moe_utils.te_general_gemm, set to None when the module
             leaves it undefined
  why        megatron-core 0.16 defines it only when TE imports, but its MoE layers read the name
             (and branch on it being None) whatever the spec: without TE an MoE model fails with
             NameError at build
  versions   megatron-core 0.16.1 (needed); 0.19.2 defines it itself (nothing is done there)
  checked    `check()` at start-up: moe_utils imports
"""

from __future__ import annotations

from megatron_flash.trainer.patches.base import PatchMismatch


def apply() -> bool:
    """Define the name as None where the module has none; True when this did something."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True


def check() -> None:
    try:
        from megatron.core.transformer.moe import moe_utils  # noqa: F401
    except ImportError as error:
        raise PatchMismatch("megatron.core.transformer.moe.moe_utils", f"does not import ({error})") from None
