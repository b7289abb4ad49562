"""Log-probabilities and entropy of given tokens from vocabulary-parallel logits.

Each TP rank holds logits for a contiguous slice of the (padded) vocabulary. We never gather the
full vocabulary: the max, the sum of exponentials and the target logit are each one all-reduce of a
[B, S] tensor. Padded vocabulary columns (index ≥ the real vocabulary size) are masked to −inf so
they never take probability mass; this is what makes TP = 1 and TP = 2 (padded differently) agree
with each other and with the HF model.

  logprob(y) = z_y − m − log Σ_v exp(z_v − m)         m = max_v z_v   (z = logits / temperature)
  entropy    = log Σ exp(z − m) + m − Σ_v p_v z_v

`vocab_parallel_logprobs` (what the trainer uses) walks the tokens in chunks and keeps per token only
m, Σ exp(z − m), Σ exp(z − m)(z − m) and the target's z − m; its backward recomputes each chunk. An
fp32 copy of the logits (and of their exponentials) never exists for more than one chunk: at 16k
tokens × 152k vocabulary the whole-tensor version holds ≈ 10 GB in each. Gradients, per column v of
a token whose target is y, with p = softmax(z) and s = z − m:

  ∂logprob/∂z_v = 1[v = y] − p_v          ∂entropy/∂z_v = −p_v (s_v − Σ_u p_u s_u)

`vocab_parallel_logprobs_reference` is the plain whole-tensor version, kept beside it as the
reference the tests compare with.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _reduce(x: torch.Tensor, group: Optional[dist.ProcessGroup], tp_size: int) -> torch.Tensor:
    """All-reduce sum forward, identity backward (each rank's slice gets its own gradient)."""
    if tp_size == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=group)


def vocab_parallel_logprobs_reference(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """logits [B, S, V_local] (this rank's vocabulary slice), targets [B, S] (or [B, S, J]: J tokens
    per position) global ids.

    Returns (logprobs of targets' shape, float32, entropy [B, S] or None). Differentiable w.r.t. logits.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = logits.float() / temperature
    v_local = z.shape[-1]
    start = tp_rank * v_local
    columns = torch.arange(start, start + v_local, device=z.device)
    padded = columns >= vocab_size
    if bool(padded.any()):
        z = z.masked_fill(padded, float("-inf"))

    with torch.no_grad():
        m = z.max(dim=-1).values
        if tp_size > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = z - m.unsqueeze(-1)
    sum_exp = _reduce(shifted.exp().sum(dim=-1), tp_group, tp_size)
    log_z = sum_exp.log()

    rows = targets.dim() == 3
    local = (targets if rows else targets.unsqueeze(-1)) - start
    owned = (local >= 0) & (local < v_local)
    picked = shifted.gather(-1, local.clamp(0, v_local - 1))
    target_shifted = _reduce(torch.where(owned, picked, torch.zeros_like(picked)), tp_group, tp_size)
    logprobs = target_shifted - log_z.unsqueeze(-1)
    logprobs = logprobs if rows else logprobs.squeeze(-1)

    entropy = None
    if with_entropy:
        probs = (shifted - log_z.unsqueeze(-1)).exp()
        p_times_z = (probs * shifted.masked_fill(padded, 0.0)).sum(dim=-1)
        entropy = log_z - _reduce(p_times_z, tp_group, tp_size)
    return logprobs, entropy


CHUNK_ELEMENTS = 1 << 24  # fp32 elements of one chunk (64 MB; 110 tokens at a 152k vocabulary)


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """logits [B, S, V_local] (this rank's vocabulary slice, any float dtype, views welcome), targets
    [B, S] global ids, or [B, S, J] for J tokens per position (the sampled one and a teacher's top-k:
    one pass over the logits for all). Returns (logprobs of targets' shape float32, entropy [B, S]
    float32 or None);
    differentiable w.r.t. logits. Equal to the reference to fp32 rounding; memory beyond the inputs
    and the gradient is a few [chunk, V_local] fp32 tensors."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    rows = targets.dim() == 3
    lp, ent = _ChunkedLogprobs.apply(logits, targets if rows else targets.unsqueeze(-1),
                                     _Settings(vocab_size, tp_rank, tp_size, tp_group, temperature, with_entropy,
                                               chunk_elements))
    return (lp if rows else lp.squeeze(-1)), (ent if with_entropy else None)


class _Settings:
    def __init__(self, vocab_size: int, tp_rank: int, tp_size: int, tp_group: Optional[dist.ProcessGroup],
                 temperature: float, with_entropy: bool, chunk_elements: int) -> None:
        self.vocab_size, self.tp_rank, self.tp_size, self.tp_group = vocab_size, tp_rank, tp_size, tp_group
        self.temperature, self.with_entropy, self.chunk_elements = temperature, with_entropy, chunk_elements


def _chunks(logits: torch.Tensor, chunk_elements: int):
    """(row, first position, last position + 1) spans of at most chunk_elements / V_local tokens:
    slices of one row are views, so no copy of a non-contiguous input (e.g. output[:, :-1]) is made."""
    b, s, v = logits.shape
    step = max(1, chunk_elements // max(v, 1))
    for i in range(b):
        for lo in range(0, s, step):
            yield i, lo, min(s, lo + step)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, st: _Settings):  # type: ignore[override]
        """targets [B, S, J]; returns logprobs [B, S, J] and entropy [B, S]."""
        ctx.set_materialize_grads(False)  # an output nobody used gets None, not a tensor of zeros
        b, s, v_local = logits.shape
        start = st.tp_rank * v_local
        dev = logits.device
        padded = torch.arange(start, start + v_local, device=dev) >= st.vocab_size
        any_padded = bool(padded.any())
        m = torch.empty(b, s, dtype=torch.float32, device=dev)
        s1 = torch.empty_like(m)
        s2 = torch.zeros_like(m)
        tgt = torch.zeros(targets.shape, dtype=torch.float32, device=dev)
        local = targets - start
        owned = (local >= 0) & (local < v_local)
        local = local.clamp(0, v_local - 1)
        for i, lo, hi in _chunks(logits, st.chunk_elements):
            z = logits[i, lo:hi].float() / st.temperature
            if any_padded:
                z = z.masked_fill(padded, float("-inf"))
            mc = z.max(dim=-1).values
            # A slice that is all vocabulary padding (TP ranks past the real vocabulary) has max −inf:
            # shift it by 0 instead (its sums are 0 either way; −inf − (−inf) would be nan).
            mc = torch.where(torch.isfinite(mc), mc, torch.zeros_like(mc))
            z -= mc.unsqueeze(-1)  # z is now s = z − m (this rank's max, rescaled below)
            m[i, lo:hi] = mc
            tgt[i, lo:hi] = z.gather(-1, local[i, lo:hi])
            e = z.exp()
            s1[i, lo:hi] = e.sum(dim=-1)
            if st.with_entropy:
                if any_padded:
                    z = z.masked_fill(padded, 0.0)  # exp(−inf)·(−inf) would be nan; these columns weigh 0
                s2[i, lo:hi] = (e * z).sum(dim=-1)
        tgt = torch.where(owned, tgt, torch.zeros_like(tgt))
        if st.tp_size > 1:  # move every rank's sums to the global max, then add them up
            m_global = m.clone()
            dist.all_reduce(m_global, op=dist.ReduceOp.MAX, group=st.tp_group)
            d = m - m_global
            scale = d.exp()
            s2 = scale * (s2 + d * s1)
            s1 = scale * s1
            tgt = torch.where(owned, tgt + d.unsqueeze(-1), tgt)
            for x in (s1, s2, tgt):
                dist.all_reduce(x, group=st.tp_group)
            m = m_global
        log_z = s1.log()
        logprobs = tgt - log_z.unsqueeze(-1)
        mean_s = s2 / s1  # Σ_v p_v s_v
        entropy = log_z - mean_s
        ctx.save_for_backward(logits, local, owned, m, s1, mean_s)
        ctx.st, ctx.padded, ctx.any_padded = st, padded, any_padded
        return logprobs, entropy

    @staticmethod
    def backward(ctx, g_lp: Optional[torch.Tensor], g_ent: Optional[torch.Tensor]):  # type: ignore[override]
        logits, local, owned, m, s1, mean_s = ctx.saved_tensors
        st = ctx.st
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        use_ent = st.with_entropy and g_ent is not None
        for i, lo, hi in _chunks(logits, st.chunk_elements):
            z = logits[i, lo:hi].float() / st.temperature
            if ctx.any_padded:
                z = z.masked_fill(ctx.padded, float("-inf"))
            z -= m[i, lo:hi].unsqueeze(-1)
            p = z.exp() / s1[i, lo:hi].unsqueeze(-1)
            gz = torch.zeros_like(p)
            if g_lp is not None:
                gl = g_lp[i, lo:hi]  # [n, J]: every target's logprob takes −p from each column, +1 at its own
                gz -= p * gl.sum(dim=-1, keepdim=True)
                hit = torch.where(owned[i, lo:hi], gl, torch.zeros_like(gl))
                gz.scatter_add_(-1, local[i, lo:hi], hit)
            if use_ent:
                if ctx.any_padded:
                    z = z.masked_fill(ctx.padded, 0.0)
                gz -= p * (z - mean_s[i, lo:hi].unsqueeze(-1)) * g_ent[i, lo:hi].unsqueeze(-1)
            grad[i, lo:hi] = gz / st.temperature
        return grad, None, None
