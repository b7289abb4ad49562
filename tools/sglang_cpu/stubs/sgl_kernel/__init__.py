"""Import-time stand-in for the ``sgl_kernel`` extension (pip name ``sglang-kernel``) on a CPU box.

SGLang 0.5.23 with ``SGLANG_USE_CPU_ENGINE=1`` does ``from sgl_kernel import <name>_cpu`` at module
import time (kv-cache moves, speculative-decoding helpers) even though, for a plain dense model served
with ``--attention-backend torch_native --sampling-backend pytorch`` and no speculative decoding, none
of them is ever called. The real package is a CUDA/AMX wheel that cannot be installed here, so this
stub provides exactly the names that import path needs. Each one raises ``NotImplementedError`` when
called, so a code path that really needs a kernel fails loudly instead of computing garbage.

Everything else is deliberately absent: SGLang wraps its other ``sgl_kernel`` imports (e.g.
``sgl_kernel.scalar_type``) in ``try/except ImportError`` and falls back to pure-PyTorch code, and an
absent attribute keeps it on that fallback. The list was found by starting the server with an empty
stub and adding each name an ``ImportError`` reported (docs/sglang_cpu_contract.md).
"""

__version__ = "0.0.0+megatron-flash-cpu-stub"


def _unavailable(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this is megatron-flash's CPU import stub "
            "(tools/sglang_cpu/stubs/sgl_kernel): this SGLang code path needs the real kernel"
        )

    op.__name__ = name
    op.__qualname__ = name
    return op


# sglang/kernels/ops/kvcache/cache_move.py (imported by mem_cache/memory_pool.py)
copy_all_layer_kv_cache_cpu = _unavailable("copy_all_layer_kv_cache_cpu")
# sglang/srt/mem_cache/allocation.py (speculative / hisparse extend path only)
assign_req_to_token_pool_cpu = _unavailable("assign_req_to_token_pool_cpu")
# sglang/kernels/ops/speculative/* (EAGLE helpers; speculative decoding is not enabled)
build_tree_kernel_efficient_cpu = _unavailable("build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = _unavailable("verify_tree_greedy_cpu")
assign_draft_cache_locs_contiguous_cpu = _unavailable("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _unavailable("assign_extend_cache_locs_cpu")
fill_accept_out_cache_loc_cpu = _unavailable("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _unavailable("fill_bonus_tokens_cpu")

__all__ = [
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
]
