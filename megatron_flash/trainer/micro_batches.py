"""This rank's micro-batches of a global batch: packed rows (default) or padded fixed-size slices.

The global batch is the trainer's padded layout (`tokens` [B, S], per-token fields [B, S], per-
sample fields [B]; every rank holds all of it). A `Micro` is what one forward/backward pass runs:

  model input   tokens / positions [r, T] (+ for a packed row, Megatron's `PackedSeqParams` in THD
                layout: the samples' `cu_seqlens`, honoured by TE's attention and, on the local
                spec, by megatron_flash/trainer/packed_attention.py)
  loss view     `fields`: the micro-batch's samples as a TrainBatch of [n, w] / [n] slices of the global batch,
                exactly what a padded micro-batch gave the loss before packing existed, so losses
                and aggregation never see the packing
  unpack        `unpack(x)` turns a per-position model output of the row ([1, T] or [1, T, V])
                into that [n, w] view; the padded path needs none (rows are samples)

Packed: see megatron_flash/trainer/packing.py for the plan. Padded (trainer.pack_sequences=false,
the layout before packing): each DP rank takes a contiguous B / DP slice cut into micro-batches of
`micro_batch_size` rows of the full width S, topped up with masked copies of row 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from megatron_flash.types import TrainBatch
from megatron_flash.trainer import context_parallel, shared_prefix
from megatron_flash.trainer.packing import (
    SampleTooLong,
    cu_seqlens,
    packed_inputs,
    plan_micro_batches,
    round_up,
    unpack_index,
)


@dataclasses.dataclass
class Micro:
    tokens: torch.Tensor  # [r, T] model input
    positions: torch.Tensor  # [r, T]
    fields: TrainBatch  # the loss's [n, w] / [n] view (no lengths)
    sample_ids: torch.Tensor  # [n] global row of each sample; -1 for filler rows (never reported)
    packed_seq_params: Any = None
    index: Optional[torch.Tensor] = None  # [n, w] positions in the packed row
    valid: Optional[torch.Tensor] = None  # [n, w]
    real: Optional[torch.Tensor] = None  # [r, T] bool: a sample's token (not padding, not a filler)
    routable: Optional[torch.Tensor] = None  # [r, T] bool: a token (a filler's too), not padding
    routes: Optional[torch.Tensor] = None  # [r, T, layers * top_k] the engine's experts (routing replay)
    routed: Optional[torch.Tensor] = None  # [r, T] bool: the token has a recorded route
    extra_src: Optional[torch.Tensor] = None  # shared prefixes: [K] row positions whose logits predict
    extra_rows: Optional[torch.Tensor] = None  # [K] this micro-batch's sample …
    extra_cols: Optional[torch.Tensor] = None  # [K] … token at this column (trainer/shared_prefix.py)
    row: Optional[torch.Tensor] = None  # context parallelism: the whole row's tokens [1, T] (tokens: this rank's)
    cp_index: Optional[torch.Tensor] = None  # [T / CP] the row positions this rank holds (context_parallel.py)
    cp_order: Optional[torch.Tensor] = None  # [T] each row position's index in the gathered local rows

    @property
    def row_len(self) -> int:
        """The whole row's tokens (under context parallelism every CP rank's share together: Megatron's
        pipeline divides it by CP for the activations a stage sends)."""
        return int((self.tokens if self.row is None else self.row).shape[1])

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[n, w, ...] loss-view values → the model rows' layout [r, T, ...] (value of column c where
        token c sits), 0 on padding: the inverse of `unpack` (e.g. the teacher's top-K ids per token)."""
        if self.index is None:
            return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, self.row_len - x.shape[1]))
        row = x.new_zeros((1, self.row_len) + tuple(x.shape[2:]))
        valid = self.valid.to(x.device) & (self.index.to(x.device) < self.row_len)  # extras are not in the row
        row[0, self.index.to(x.device)[valid]] = x[valid]
        return row

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[1, T, ...] per-position values of the packed row → [n, w, ...]; padding positions 0.
        Column 0 of each sample is 0 too (nothing in the sample predicts its first token). With
        shared prefixes x is [1, T + K, ...]: the row's values, then those of the extras."""
        if self.index is None:
            return x
        out = x[0][self.index.to(x.device)]
        keep = self.valid.to(x.device).clone()
        keep[:, 0] = False
        keep = keep.view(keep.shape + (1,) * (out.dim() - 2))
        return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))


@dataclasses.dataclass(frozen=True)
class BatchingOptions:
    pack: bool = True
    micro_batch_size: int = 4  # samples per micro-batch (a cap when packing)
    max_tokens: int = 0  # packing: token budget per micro-batch, 0 = none
    max_seq_len: int = 0  # longest sample accepted, 0 = no check
    shared_prefix: bool = False  # a group's samples share their prompt in one segment (trainer/shared_prefix.py)
    pad_multiple: int = 1  # rows padded to a multiple of this (TP size, for sequence parallel)
    equal_rows: bool = False  # pipeline parallel: every row of the step has the same length
    equal_counts: bool = False  # expert parallel: every DP rank runs the same number of micro-batches
    min_micro_batches: int = 1
    micro_batch_multiple: int = 1
    cp_size: int = 1  # context parallelism: each row is split over this many ranks (context_parallel.py)
    cp_rank: int = 0
    cp_group: Any = None


def sample_lengths(batch: TrainBatch, *, max_seq_len: int = 0) -> list[int]:
    """Tokens of each sample (prompt + response): the batch's `lengths` (set by `collate`) when
    present, else the row width (every token of the row counts)."""
    if batch.lengths is not None:
        lengths = [int(n) for n in batch.lengths.tolist()]
    else:
        lengths = [int(batch.tokens.shape[1])] * batch.num_samples
    if max_seq_len:
        for i, n in enumerate(lengths):
            if n > max_seq_len:
                raise SampleTooLong(f"sample {i} has {n} tokens (prompt + response), more than "
                                    f"trainer.max_seq_len={max_seq_len}")
    return lengths


def build_micro_batches(batch: TrainBatch, opts: BatchingOptions, *, dp_rank: int,
                        dp_size: int, device: torch.device) -> list[Micro]:
    lengths = sample_lengths(batch, max_seq_len=opts.max_seq_len)
    if opts.pack:
        return _packed(batch, lengths, opts, dp_rank=dp_rank, dp_size=dp_size, device=device)
    return _padded(batch, opts, dp_rank=dp_rank, dp_size=dp_size, device=device)


def _fields(batch: TrainBatch, rows: torch.Tensor, width: int, device: torch.device) -> TrainBatch:
    return batch.map(lambda t: t[rows][:, :width].to(device), lambda t: t[rows].to(device),
                     drop=("lengths", "routed_experts"))


def _packed(batch: TrainBatch, lengths: list[int], opts: BatchingOptions, *, dp_rank: int,
            dp_size: int, device: torch.device) -> list[Micro]:
    units = None
    if opts.shared_prefix and batch.group_ids is not None and batch.prompt_lengths is not None:
        units = shared_prefix.shared_units(batch.tokens, lengths, batch.prompt_lengths.tolist(),
                                           batch.group_ids.tolist(), max_tokens=opts.max_tokens,
                                           max_samples=opts.micro_batch_size)
    cp = opts.cp_size
    plan = plan_micro_batches(lengths, dp_size=dp_size, max_tokens=opts.max_tokens,
                              max_samples=opts.micro_batch_size,
                              # under CP: every sequence in 2·CP chunks, each rank's row a multiple of TP
                              pad_multiple=opts.pad_multiple * (2 * cp if cp > 1 else 1),
                              equal_rows=opts.equal_rows, equal_counts=opts.equal_counts,
                              min_micro_batches=opts.min_micro_batches,
                              micro_batch_multiple=opts.micro_batch_multiple, units=units,
                              seq_multiple=2 * cp if cp > 1 else 1)[dp_rank]
    tokens = batch.tokens
    micro = []
    for mb in plan:
        width = max(mb.lengths)
        rows = torch.tensor(mb.indices)
        fields = _fields(batch, rows, width, device)
        if mb.filler:  # trains nothing; its logprobs are never reported
            fields = fields.replace(loss_mask=torch.zeros_like(fields.loss_mask))
        layout = None
        if mb.segments and not mb.filler:
            layout = shared_prefix.row_layout(mb, tokens, width)
            row, positions, index, valid = layout.tokens, layout.positions, layout.index, layout.valid
        else:
            row, positions = packed_inputs(mb, tokens, pad_id=0)
            index, valid = unpack_index(mb, width)
        real = torch.arange(mb.row_len)[None, :] < (0 if mb.filler else mb.num_tokens)
        m = Micro(tokens=row.to(device), positions=positions.to(device), fields=fields,
                  sample_ids=torch.full((1,), -1) if mb.filler else rows, index=index, valid=valid, real=real,
                  routable=torch.arange(mb.row_len)[None, :] < mb.num_tokens)
        m.packed_seq_params = packed_seq_params(mb.segment_lengths(), device)
        if layout is not None:  # its attention plans, typed (its RoPE positions are m.positions)
            m.packed_seq_params = shared_prefix.with_plans(m.packed_seq_params, layout, device)
            if layout.extra_src.numel():
                m.extra_src, m.extra_rows, m.extra_cols = (t.to(device) for t in
                                                           (layout.extra_src, layout.extra_rows, layout.extra_cols))
        if cp > 1:  # this rank's chunks of every sequence (shared prefixes are refused under CP)
            m = context_parallel.localize(m, mb.segment_lengths(), cp_size=cp, cp_rank=opts.cp_rank,
                                          group=opts.cp_group, device=device)
        if batch.routed_experts is not None and not mb.filler:
            m.routes = torch.cat([batch.routed_experts[i, :n] for i, n in zip(mb.indices, mb.lengths)]
                                 + [batch.routed_experts.new_zeros(mb.row_len - mb.num_tokens,
                                                                   batch.routed_experts.shape[-1])])[None]
            m.routed = torch.cat([torch.arange(n) < n - 1 for n in mb.lengths]
                                 + [torch.zeros(mb.row_len - mb.num_tokens, dtype=torch.bool)])[None]
        elif batch.routed_experts is not None:  # a filler row: nothing recorded, own routing is as good
            m.routes = batch.routed_experts.new_zeros(1, mb.row_len, batch.routed_experts.shape[-1])
            m.routed = torch.zeros(1, mb.row_len, dtype=torch.bool)
        micro.append(m)
    return micro


def packed_seq_params(segments: list[int], device: torch.device) -> Any:
    """Megatron's THD description of a packed row: one causal segment per sample (+ the padding tail)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seqlens(segments, device)
    longest = max(segments)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def _padded(batch: TrainBatch, opts: BatchingOptions, *, dp_rank: int, dp_size: int,
            device: torch.device) -> list[Micro]:
    tokens = batch.tokens
    b, seq = tokens.shape
    width = round_up(seq, opts.pad_multiple)
    per_rank = -(-b // dp_size)
    mbs = min(opts.micro_batch_size, per_rank)
    per_rank = round_up(per_rank, mbs)
    count = round_up(max(per_rank // mbs, opts.min_micro_batches), opts.micro_batch_multiple)
    per_rank = count * mbs
    ids = torch.arange(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    real = ids < b
    rows = torch.where(real, ids, torch.zeros_like(ids))  # masked copies of row 0 fill the slice
    fields = _fields(batch, rows, seq, device)
    fields = fields.replace(loss_mask=fields.loss_mask * real.to(device)[:, None])
    if width != seq:
        fields = fields.map(lambda t: torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - seq)),
                            lambda t: t)
    positions = torch.arange(width, device=device).unsqueeze(0).expand(mbs, width)
    row_lengths = torch.tensor(sample_lengths(batch))[rows]  # a filler row is a copy of row 0
    lengths = row_lengths * real
    tokens_real = torch.arange(width)[None, :] < lengths[:, None]
    routable = torch.arange(width)[None, :] < row_lengths[:, None]
    routes = routed = None
    if batch.routed_experts is not None:
        routes = torch.nn.functional.pad(batch.routed_experts[rows], (0, 0, 0, width - seq))
        routed = torch.arange(width)[None, :] < (lengths[:, None] - 1)
    micro = []
    for lo in range(0, per_rank, mbs):
        part = fields.rows(slice(lo, lo + mbs))
        micro.append(Micro(tokens=part.tokens, positions=positions, fields=part,
                           sample_ids=torch.where(real[lo:lo + mbs], ids[lo:lo + mbs], -1),
                           real=tokens_real[lo:lo + mbs], routable=routable[lo:lo + mbs],
                           routes=None if routes is None else routes[lo:lo + mbs],
                           routed=None if routed is None else routed[lo:lo + mbs]))
    return micro


def scatter_rows(micro: list[Micro], values: list[torch.Tensor], shape: tuple[int, ...],
                 device: torch.device) -> torch.Tensor:
    """Each micro-batch's [n, w, ...] rows into a zero [B, S, ...] tensor at their global rows."""
    out = torch.zeros(shape, device=device)
    for m, v in zip(micro, values):
        keep = m.sample_ids >= 0
        if not bool(keep.any()):
            continue
        w = min(v.shape[1], shape[1])
        out[m.sample_ids[keep].to(device), :w] = v[keep.to(v.device), :w].to(out.dtype)
    return out
