"""The plan of a sync: who sends and what, in buckets of HF tensors.

Every PP stage has one *sender* of its dense parameters: its TP rank 0 of DP rank 0. Within the stage
all TP ranks all-gather each parameter (collectives), the sender turns it into HF tensors (name map,
vocab padding stripped) and groups them into buckets of `bucket_bytes`. MoE experts leave from the
rank that owns them (expert-TP 0, expert-DP 0 of each expert-parallel rank), so under EP a stage has
one sender per EP rank — unless the transport needs one sender per stage (`gather_experts`: every
expert is then gathered over the EP group to the stage's sender). Peak extra memory on a sender is
one bucket plus the parameter being gathered.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from megatron_flash.hf.io import stage_hf_tensors

Bucket = list[tuple[str, torch.Tensor]]


def bucket_nbytes(bucket: Bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


def hf_buckets(policy: Any, *, bucket_bytes: int, gather_experts: bool = False, copy: bool = True) -> Iterator[Bucket]:
    """This rank's share of its PP stage's HF tensors in buckets (empty unless it is a sender; every
    rank of the stage must exhaust the iterator because it drives the all-gathers).

    `copy`: every tensor in its own fresh contiguous host storage (a broadcast needs contiguous tensors,
    and nothing sent may alias the trainer's parameters). Without it a tensor may be a view of a
    parameter (a replicated norm weight, q/k/v of one fused tensor): for transports that copy
    what they keep (`copies_buckets`), which saves one copy of the whole state per sync."""
    bucket: Bucket = []
    size = 0
    for name, tensor in stage_hf_tensors(policy.model, spec=policy.spec, layout=policy.layout,
                                         gather_experts=gather_experts):
        tensor = tensor.detach()
        if copy:
            tensor = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)  # host memory, as engines take it
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def sender_bytes_bound(policy: Any) -> int:
    """At least the bytes this rank sends in a sync: its parameters × TP (dense ones are gathered
    over TP) × EP (experts gathered to one sender, where a transport wants that)."""
    from megatron_flash.hf.io import _chunk_params

    local = sum(p.numel() * p.element_size() for _, _, p in _chunk_params(policy.model))
    layout = policy.layout
    return max(1, local * layout.tp_size * max(1, getattr(layout, "ep_size", 1)))
