"""Are the trainer's gradients worth a step, and its weights still usable after one? Checked on every
optimizer step, before the weights can reach an engine.

Gradients (`grad_state`): a NaN/inf anywhere skips the update (it would poison every weight it reaches);
all exactly zero (every advantage and loss term zero) skips it too, unless optimizer.skip_zero_grad is
off: an Adam step on a zero gradient still decays both moments and counts a step, so after thousands of
them on a saturated task the next real gradient is divided by a second moment that has decayed toward
zero, and weight decay shrinks the weights with nothing learned.

Weights (`weights_finite`):
A step with finite gradients can still blow the weights up (a huge learning rate, an Adam step on a
tiny second moment): weights of 1e30 are finite, but their logits overflow into NaN. The weight-sync
probe sees that only at the next push, and only when it runs; this check sees it at the step. A tensor
fails when its squared L2 norm is not finite in float32: a NaN/inf anywhere in it, or a norm above
~1.8e19, which no trained weight reaches. Every rank decides alike (one MAX all-reduce over the
default group), so every rank stops together.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist


def grad_state(chunks: Iterable[Any], *, device: torch.device) -> tuple[bool, bool]:
    """(every gradient of every rank finite, any gradient element non-zero on any rank), read after
    Megatron's data-parallel reduction; one MAX all-reduce, so every rank decides alike."""
    flags = torch.zeros(2, device=device)  # [any non-finite, any non-zero]
    for chunk in chunks:
        for param in chunk.parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is not None:  # stays on the device: one host sync for the whole model, below
                flags[0] += (~torch.isfinite(grad)).any().to(flags.dtype)
                flags[1] += grad.ne(0).any().to(flags.dtype)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    bad, nonzero = flags.tolist()
    return not bad, bool(nonzero)


def weights_finite(chunks: Iterable[Any], *, device: torch.device) -> bool:
    """True when every rank's local weights pass (see the module docstring); one host sync."""
    bad = torch.zeros(1, device=device)
    for chunk in chunks:
        for param in chunk.parameters():
            norm = torch.linalg.vector_norm(param.detach(), dtype=torch.float32)
            bad += (~torch.isfinite(norm * norm)).to(bad.dtype)  # stays on the device until .item()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bool(bad.item())
