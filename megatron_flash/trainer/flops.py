"""Model FLOPs of a training step, and the utilisation they give (MFU), from the checkpoint's shape.

Counted per real token (padding and filler rows are not useful work), forward + backward = 3 × forward,
2 FLOPs per multiply-add:

  matmuls    6 · N            N = weights one token multiplies through:
                                per layer  h·(a·d + 2·g·d) [QKV] + a·d·h [out proj]
                                           + 3·h·f [gated MLP]   (MoE: k·3·h·f_e + h·E [router])
                                and h·V once for the output layer (the input embedding is a lookup)
  attention  6 · a·d · L(L+1) per layer and sample of L tokens, causal, over the sample's own tokens
             (forward: QKᵀ and PV, a·d·L(L+1)/2 multiply-adds each)

With LoRA the base weights get no weight gradient: matmuls count 4 · N (forward and input gradient)
plus 6 per adapter weight. h hidden, a query heads, g key/value groups, d head dim, f MLP width, V vocabulary, E experts, k
routed per token, f_e expert width. Norms, RoPE, softmax and the loss are left out (they are O(h) or
O(V) per token, not O(h²)). MFU = model FLOPs / (seconds · peak FLOP/s of one GPU · GPUs); the peak is
the dense bf16 figure of the GPU's datasheet (PEAK_BF16), and none is claimed for a CPU or an unknown
GPU (mfu is then reported as null).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

from megatron_flash.hf.spec import HFModelSpec

if TYPE_CHECKING:
    import torch

PEAK_BF16 = {  # dense bf16 tensor-core FLOP/s per GPU, by a substring of torch.cuda.get_device_name()
    "H200": 989e12, "H100": 989e12, "H800": 989e12, "H20": 148e12,
    "A100": 312e12, "A800": 312e12, "L40S": 362e12, "B200": 2250e12,
}


def matmul_weights_per_token(spec: HFModelSpec) -> int:
    h, a, g, d = spec.hidden_size, spec.num_attention_heads, spec.num_query_groups, spec.head_dim
    attention = h * (a * d + 2 * g * d) + a * d * h
    if spec.moe is not None:
        mlp = spec.moe.top_k * 3 * h * spec.moe.ffn_hidden_size + h * spec.moe.num_experts
    else:
        mlp = 3 * h * spec.ffn_hidden_size
    return spec.num_layers * (attention + mlp) + h * spec.vocab_size


def train_flops(spec: HFModelSpec, lengths: Sequence[int], *, adapter_weights: int = 0) -> float:
    """Model FLOPs of one forward + backward over samples of these lengths (tokens each); with
    `adapter_weights` > 0 (LoRA: the adapters' weights one token multiplies through) the base is frozen."""
    n = matmul_weights_per_token(spec)
    per_token = 4 * n + 6 * adapter_weights if adapter_weights else 6 * n
    ad = spec.num_attention_heads * spec.head_dim
    return float(sum(per_token * L + 6 * ad * L * (L + 1) * spec.num_layers for L in lengths))


def peak_flops(device_name: Optional[str]) -> Optional[float]:
    """Dense bf16 peak of one GPU by name; None for a CPU or a GPU not in PEAK_BF16."""
    if not device_name:
        return None
    for key in sorted(PEAK_BF16, key=len, reverse=True):  # "H200" before "H20"
        if key in device_name:
            return PEAK_BF16[key]
    return None


def shared_flops(spec: HFModelSpec, prefix: int, lengths: Sequence[int], *, adapter_weights: int = 0) -> float:
    """Model FLOPs of samples of these lengths that share their first `prefix` tokens
    (trainer.shared_prefix): the matmuls over the prefix once plus every sample's rest, and the
    attention pairs each token has (the prefix on itself; a response token on the prefix and on its own
    earlier tokens)."""
    n = matmul_weights_per_token(spec)
    per_token = 4 * n + 6 * adapter_weights if adapter_weights else 6 * n
    ad = spec.num_attention_heads * spec.head_dim
    rests = [length - prefix for length in lengths]
    pairs = prefix * (prefix + 1) // 2 + sum(r * prefix + r * (r + 1) // 2 for r in rests)
    return float(per_token * (prefix + sum(rests)) + 12 * ad * pairs * spec.num_layers)


def step_speed(spec: HFModelSpec, lengths: Sequence[int], *, seconds: float, num_gpus: int,
               device: "torch.device", adapter_weights: int = 0,
               flops: Optional[float] = None) -> dict[str, Optional[float]]:
    """A train step's speed metrics: mfu (null without a known peak), tokens_per_s_per_gpu,
    model_tflops_per_gpu, and peak_mem_gb: on CUDA the step's peak of allocated memory (the caller
    resets the peak at the start of the step), on a CPU the process's peak resident set so far.
    `flops`: the step's model FLOPs when they are not those of `lengths` (shared prefixes)."""
    import resource

    import torch

    seconds = max(seconds, 1e-9)
    flops = flops if flops is not None else train_flops(spec, lengths, adapter_weights=adapter_weights)
    on_cuda = device.type == "cuda"
    peak = peak_flops(torch.cuda.get_device_name(device)) if on_cuda else None
    if on_cuda:
        mem = torch.cuda.max_memory_allocated(device) / 1e9
    else:
        mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux
    return {
        "mfu": flops / (seconds * peak * num_gpus) if peak else None,
        "tokens_per_s_per_gpu": sum(lengths) / seconds / num_gpus,
        "model_tflops_per_gpu": flops / seconds / num_gpus / 1e12,
        "peak_mem_gb": mem,
    }


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of optimizer state on this rank: every tensor of the inner torch optimizers' state (Adam's
    moments and step) plus their float32 master copies where the model trains in 16 bits. With LoRA
    only the adapters have any."""
    import torch

    total = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            continue
        for state in inner.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
        if getattr(opt, "config", None) is not None and (opt.config.bf16 or opt.config.fp16):
            total += sum(p.numel() * p.element_size() for g in inner.param_groups for p in g["params"])
    return total
