"""Are the trainer's weights still usable after an update? Checked on every optimizer step, before the
weights can reach an engine.

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
