"""Everything megatron-flash changes inside megatron-core and torch, one module per change.

Megatron-Core has no extension point for these; each module says what it replaces, why, for which
versions, and how it is checked. `megatron_compat.check()` runs every module's `check()` before the
model is built, so a megatron-core whose internals moved fails at start-up with one line naming the
version and the target, never mid-run. Outside this package no code assigns to an attribute of a
megatron or torch module or class (tests/unit/test_patches.py reads the source to make sure).

  module           replaces                                          applied
  ---------------  ------------------------------------------------  ---------------------------------
  packed_rope      rope_utils._apply_rotary_pos_emb_thd              model build (every run)
  cpu              torch.cuda.current_device, Megatron modules'      init_distributed, CPU only
                   `torch`, the CUDA RNG tracker, Tensor.type/.cuda
  async_save       dist_checkpointing.save's synchronous path, its   every checkpoint save
                   results queue; forked writers die with the trainer
  optimizer_load   DistributedOptimizer._set_main_param_and_         a fully-reshardable load
                   optimizer_states (per optimizer object)
  moe_gemm         moe_utils.te_general_gemm (undefined without TE)  model build, MoE without TE
  lora_linear      the class of each adapted parallel linear         LoRA on
  explicit_positions  GPTModel._preprocess (a subclass): packed rows'   model build (every run)
                   RoPE positions from position_ids
  cp_attention     DotProductAttention.__init__'s CP == 1 assertion  core attention build, CP > 1
"""

from __future__ import annotations

from megatron_flash.trainer.patches import (
    async_save,
    cp_attention,
    cpu,
    explicit_positions,
    lora_linear,
    moe_gemm,
    optimizer_load,
    packed_rope,
)

PATCHES = (packed_rope, explicit_positions, cp_attention, cpu, async_save, optimizer_load, moe_gemm, lora_linear)
"""Every patch module; each has `check()`."""
CPU_ONLY = (cpu,)
