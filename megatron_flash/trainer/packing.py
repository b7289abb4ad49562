"""Sequence packing: which samples go into which micro-batch of which DP rank (pure Python + torch).

RL responses are long-tailed, so padding every sample of a step to the longest one makes most of the
trainer's compute padding. Instead each micro-batch is *one row* of whole samples laid end to end;
attention never crosses a sample boundary and positions restart at 0 for each sample (the row is
handed to Megatron as `PackedSeqParams` with the `cu_seqlens` of `segment_lengths`).

The plan, computed identically on every rank from the global batch's sample lengths:

  1. DP balance by tokens: samples longest first, each to the DP rank holding the fewest tokens so
     far (ties: the lower rank). Every rank then does about the same work whatever the length mix.
  2. Micro-batches by budget: on each rank, first-fit decreasing into bins of at most
     `max_tokens` tokens (0 = no token limit) and at most `max_samples` samples. The number of
     micro-batches varies with the lengths; a sample longer than the budget is an error.
  3. Row length: the bin's tokens rounded up to `pad_multiple` (TP size, for sequence parallel).
     Pipeline stages exchange activations of one fixed shape, so with PP > 1 every row of the step
     is padded to the longest row (`equal_rows`): the waste is one bin's slack, not each sample's.
  4. A rank with no sample (fewer samples than DP ranks) gets one filler micro-batch: the first token
     of sample 0 (then padding), trained on nothing, so every rank runs the same collective schedule.

Worked example: lengths [9, 2, 7, 3, 5, 1], DP 2, budget 10, no sample cap. Longest first, to the
lighter rank (ties to rank 0): 9→r0, 7→r1, 5→r1, 3→r0, 2→r0 (12 = 12), 1→r1; loads 14 and 13.
First fit on r0 [9, 3, 2] gives bins [9], [3, 2]; on r1 [7, 5, 1] gives [7, 1], [5]. Four rows of
9, 5, 8 and 5 tokens instead of six rows of 9 (33 tokens computed instead of 54).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch


class SampleTooLong(ValueError):
    """A sample does not fit the micro-batch token budget (never silently dropped)."""


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One packed row: samples `indices` (into the global batch) laid end to end in that order.

    `segments` (trainer.shared_prefix): the row's attention segments as (samples, shared prefix
    length), in order over `indices`; a segment (k, P) with P > 0 holds k samples of one prompt of P
    tokens, laid out as the prompt once and then each sample's tokens after it (trainer/shared_prefix.py).
    Empty: every sample is a segment of its own."""

    indices: tuple[int, ...]
    lengths: tuple[int, ...]
    row_len: int  # tokens in the row, padding included (>= num_tokens)
    filler: bool = False  # a rank with no sample: sample 0's first token, trains nothing
    segments: tuple[tuple[int, int], ...] = ()
    seq_multiple: int = 1
    """Every sample is padded to a multiple of this (2·CP under context parallelism: its chunks);
    the padding follows the sample's tokens inside its own segment."""

    def segment_spans(self) -> list[tuple[int, int]]:
        """(samples, shared prefix length) per segment; (1, 0) per sample when nothing is shared."""
        return list(self.segments) or [(1, 0)] * len(self.indices)

    def physical_lengths(self) -> list[int]:
        """Tokens of each segment in the row (a shared prefix once; padded to seq_multiple)."""
        out, i = [], 0
        for k, prefix in self.segment_spans():
            lens = self.lengths[i:i + k]
            out.append(round_up(prefix + sum(n - prefix for n in lens), self.seq_multiple))
            i += k
        return out

    @property
    def num_tokens(self) -> int:
        return sum(self.physical_lengths())

    def segment_lengths(self) -> list[int]:
        """Lengths of the row's attention segments: each sample (or shared segment), then the padding
        tail (if any)."""
        tail = self.row_len - self.num_tokens
        return self.physical_lengths() + ([tail] if tail else [])


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def balance_over_ranks(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Sample indices (or unit indices, `lengths` = their tokens) per DP rank, longest first, each to
    the rank with the fewest tokens so far."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    loads = [0] * dp_size
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    for i in order:
        r = min(range(dp_size), key=lambda k: (loads[k], k))
        ranks[r].append(i)
        loads[r] += lengths[i]
    return ranks


def _first_fit(indices: Sequence[int], lengths: Sequence[int], *, max_tokens: int,
               max_samples: int, counts: Optional[Sequence[int]] = None) -> list[list[int]]:
    """First-fit decreasing of items (samples, or shared-prefix units of `counts` samples each)."""
    counts = counts or [1] * len(lengths)
    bins: list[list[int]] = []
    used: list[int] = []
    held: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for b, members in enumerate(bins):
            fits = max_tokens <= 0 or used[b] + lengths[i] <= max_tokens
            if fits and held[b] + counts[i] <= max_samples:
                members.append(i)
                used[b] += lengths[i]
                held[b] += counts[i]
                break
        else:
            bins.append([i])
            used.append(lengths[i])
            held.append(counts[i])
    return bins


@dataclasses.dataclass(frozen=True)
class Unit:
    """What the plan places whole: one sample (prefix 0), or samples of one group sharing their first
    `prefix` tokens (trainer.shared_prefix), laid out as the prefix once and then each sample's rest."""

    samples: tuple[int, ...]
    prefix: int = 0

    def tokens(self, lengths: Sequence[int]) -> int:
        return self.prefix + sum(lengths[i] - self.prefix for i in self.samples)


def plan_micro_batches(lengths: Sequence[int], *, dp_size: int, max_tokens: int = 0, max_samples: int,
                       pad_multiple: int = 1, equal_rows: bool = False, equal_counts: bool = False,
                       min_micro_batches: int = 1, micro_batch_multiple: int = 1,
                       units: Optional[Sequence[Unit]] = None, seq_multiple: int = 1) -> list[list[MicroBatch]]:
    """Micro-batches for every DP rank (list index = DP rank).

    `units` (trainer.shared_prefix, trainer/shared_prefix.py makes them): place these units whole
    instead of single samples; the budget and the DP balance count a unit's tokens once per prefix,
    `max_samples` its samples.

    `seq_multiple` (context parallelism: 2·CP): every sample is padded to a multiple of it, and the
    budget and the balance count it so.

    `min_micro_batches` / `micro_batch_multiple`: the interleaved pipeline schedule needs at least PP
    micro-batches and a count it can group by PP; extra micro-batches are fillers (sample 0's first token).
    `equal_counts`: every DP rank runs as many micro-batches as the busiest (MoE under expert
    parallelism: the token dispatch is a collective over ranks of different DP ranks, once per
    micro-batch and layer); `equal_rows`: every row has the step's longest row length (pipeline
    parallel's fixed P2P shapes; the all-gather dispatcher's equal token counts).
    """
    if max_samples < 1:
        raise ValueError(f"max_samples must be >= 1, got {max_samples}")
    if max_tokens > 0:
        for i, n in enumerate(lengths):
            if n > max_tokens:
                raise SampleTooLong(f"sample {i} has {n} tokens (prompt + response), more than "
                                    f"trainer.max_tokens_per_micro_batch={max_tokens}")
    # Items: every sample alone, or (trainer.shared_prefix) units of samples that share a prompt.
    items = [Unit((i,), 0) for i in range(len(lengths))] if units is None else list(units)
    sizes = [round_up(u.tokens(lengths), seq_multiple) for u in items]
    counts = [len(u.samples) for u in items]
    plans: list[list[list[int]]] = [
        _first_fit(mine, sizes, max_tokens=max_tokens, max_samples=max_samples, counts=counts)
        for mine in balance_over_ranks(sizes, dp_size)
    ]
    rows = [round_up(max(sum(sizes[i] for i in b), 1), pad_multiple) for bins in plans for b in bins]
    common = max(rows, default=pad_multiple) if equal_rows else 0
    if equal_counts:
        min_micro_batches = max([min_micro_batches] + [len(bins) for bins in plans])
    out: list[list[MicroBatch]] = []
    for bins in plans:
        mbs = []
        for b in bins:
            samples = tuple(i for u in b for i in items[u].samples)
            lens = tuple(lengths[i] for i in samples)
            segments = tuple((len(items[u].samples), items[u].prefix) for u in b) if units is not None else ()
            mbs.append(MicroBatch(indices=samples, lengths=lens, segments=segments, seq_multiple=seq_multiple,
                                  row_len=common or round_up(sum(sizes[u] for u in b), pad_multiple)))
        count = max(len(mbs), min_micro_batches)
        count = round_up(count, micro_batch_multiple)
        filler_len = common or round_up(1, pad_multiple)
        mbs += [MicroBatch(indices=(0,), lengths=(1,), row_len=filler_len, filler=True, seq_multiple=seq_multiple)
                for _ in range(count - len(mbs))]
        out.append(mbs)
    return out


def packed_inputs(mb: MicroBatch, tokens: torch.Tensor, *, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [1, row_len], position ids [1, row_len]) of a packed row from padded `tokens` [B, S].

    Positions restart at 0 in every segment (the padding tail counts as a segment of its own); a
    sample's own padding (seq_multiple) has position 0."""
    parts, positions = [], []
    for i, n in zip(mb.indices, mb.lengths):
        pad = round_up(n, mb.seq_multiple) - n
        parts += [tokens[i, :n], torch.full((pad,), pad_id, dtype=tokens.dtype, device=tokens.device)]
        positions += [torch.arange(n, device=tokens.device), torch.zeros(pad, dtype=torch.long, device=tokens.device)]
    tail = mb.row_len - mb.num_tokens
    if tail:
        parts.append(torch.full((tail,), pad_id, dtype=tokens.dtype, device=tokens.device))
        positions.append(torch.arange(tail, device=tokens.device))
    return torch.cat(parts).unsqueeze(0), torch.cat(positions).unsqueeze(0)


def cu_seqlens(segment_lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """Cumulative segment boundaries [0, l0, l0+l1, …] as int32 (Transformer Engine's THD layout)."""
    out = torch.zeros(len(segment_lengths) + 1, dtype=torch.int32, device=device)
    out[1:] = torch.cumsum(torch.tensor(list(segment_lengths), dtype=torch.int32, device=device), 0)
    return out


def unpack_index(mb: MicroBatch, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [n, width] into the packed row, valid [n, width] bool): row j column t of the
    unpacked view is packed position offset_j + t where t < length_j."""
    n = len(mb.indices)
    offsets = torch.tensor([0] + [round_up(x, mb.seq_multiple) for x in mb.lengths[:-1]]).cumsum(0)
    cols = torch.arange(width)
    valid = cols[None, :] < torch.tensor(mb.lengths)[:, None]
    index = torch.where(valid, offsets[:, None] + cols[None, :], torch.zeros(n, width, dtype=torch.long))
    return index, valid
