"""Megatron-Core internals the trainer replaces or wraps (trainer/patches/: one module each, with what,
why and for which versions), checked once before the model is built.

A replacement written against one version's signature fails in the first step of another (the
first 0.19 run failed so: `apply_rotary_pos_emb_thd() got an unexpected keyword argument
'mla_rotary_interleaved'`). `check()` runs every patch's check now: one RuntimeError line naming the
megatron-core version, the target and what differs — at start-up, never mid-run.
"""

from __future__ import annotations

from megatron_flash.versions import installed


def version() -> str:
    return installed("megatron-core") or "unknown"


def check(*, cpu: bool) -> None:
    """Every replaced internal matches what its replacement was written for (RuntimeError otherwise);
    the CPU patches only when `cpu`."""
    from megatron_flash.trainer.patches import CPU_ONLY, PATCHES

    for patch in PATCHES:
        if cpu or patch not in CPU_ONLY:
            patch.check()
