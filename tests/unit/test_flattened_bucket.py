"""The pickled ipc path's wire format (SGLang's `flattened_bucket`): a bucket of mixed dtypes becomes one
uint8 tensor per dtype plus per-tensor byte ranges, and the local engine's safe unpickler (an allowlist
like SGLang's) rebuilds every tensor bit for bit from the payload exactly as the transport pickles it."""

from __future__ import annotations

import base64
import io
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing as mp

from megatron_flash.engines.weight_payloads import read_tensor_payload
from megatron_flash.weight_sync.transports.flat_bucket import flatten_by_dtype


def mixed_bucket() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(7, 5, generator=g)),
        ("model.layers.0.input_layernorm.weight", torch.randn(5, generator=g).to(torch.bfloat16)),  # odd byte count
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(3, 5, generator=g).t()),  # not contiguous
        ("model.layers.0.mlp.gate.e_score_correction_bias", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn((), generator=g)),  # 0-d
        ("lm_head.weight", torch.randn(0, 5, generator=g)),  # empty
    ]


@pytest.mark.parametrize("shared", [False, True])
def test_one_flat_tensor_per_dtype_holding_every_byte_in_order(shared: bool) -> None:
    bucket = mixed_bucket()
    flats = flatten_by_dtype(bucket, shared=shared)
    assert [m[0].dtype for _, m in flats] == [torch.float32, torch.bfloat16]
    for flat, metadata in flats:
        named = [(n, t) for n, t in bucket if t.dtype == metadata[0].dtype]
        assert [m.name for m in metadata] == [n for n, _ in named]
        expected = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in named])
        assert flat.dtype == torch.uint8 and torch.equal(flat, expected) and flat.is_shared() == shared
        ends = [0] + [m.end_idx for m in metadata]
        assert [m.start_idx for m in metadata] == ends[:-1] and ends[-1] == flat.numel()
        assert all(m.numel == m.end_idx - m.start_idx for m in metadata)


@pytest.mark.parametrize("shared", [False, True])
def test_local_engine_rebuilds_the_payload_exactly(shared: bool) -> None:
    bucket = mixed_bucket() + [("model.layers.1.empty_bias", torch.zeros(0, dtype=torch.float16))]  # 0 bytes
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")  # what the transport uses
    try:
        rebuilt = []
        for flat, metadata in flatten_by_dtype(bucket, shared=shared):
            buf = io.BytesIO()
            ForkingPickler(buf).dump({"flattened_tensor": flat, "metadata": metadata})
            rebuilt += read_tensor_payload(base64.b64encode(buf.getvalue()).decode(), "flattened_bucket")
    finally:
        mp.set_sharing_strategy(before)
    got = dict(rebuilt)
    assert sorted(got) == sorted(n for n, _ in bucket)
    for name, tensor in bucket:
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def test_the_flat_copy_is_private() -> None:
    """Pickling moves the flat tensor's storage into shared memory; the trainer's tensors must not move."""
    weight = torch.randn(4, 4)
    (flat, _), = flatten_by_dtype([("w", weight)])
    assert flat.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    flat.zero_()
    assert weight.abs().sum() > 0


def test_broadcast_bucket_order_aligns_every_offset_and_the_engine_rebuilds_it(monkeypatch) -> None:
    """broadcast sends a bucket as one flat tensor: largest elements first, so that the receiver's rule
    (SGLang's FlattenedTensorBucket.empty: tensors back to back, offset % itemsize == 0) holds, and the
    local engine's receive_broadcast rebuilds every tensor from those bytes."""
    from megatron_flash.engines.weight_payloads import receive_broadcast
    from megatron_flash.weight_sync.transports.broadcast import broadcast_order
    from megatron_flash.weight_sync.transports.flat_bucket import nbytes_of, pack

    g = torch.Generator().manual_seed(1)
    bucket = [("m", torch.rand(3, generator=g) > 0.5), ("a", torch.randn(3, generator=g).to(torch.bfloat16)),
              ("b", torch.randn(5, generator=g)), ("c", torch.randint(-9, 9, (3,), generator=g)),
              ("d", torch.randn(7, generator=g).to(torch.float16)), ("e", torch.randn(2, 3, generator=g).t())]

    def aligned(named) -> bool:
        offset = 0
        for _, t in named:
            if offset % t.element_size():
                return False
            offset += t.numel() * t.element_size()
        return True

    assert not aligned(bucket)  # as the bucket comes: a 3-byte bool run puts the bf16 at offset 3
    ordered = broadcast_order(bucket)
    assert [n for n, _ in ordered] == ["c", "b", "e", "a", "d", "m"]  # 8, 4, 4, 2, 2, 1 bytes; stable
    assert aligned(ordered)
    flat = torch.empty(nbytes_of(ordered), dtype=torch.uint8)
    pack(flat, ordered)
    monkeypatch.setattr(torch.distributed, "broadcast", lambda t, src, group: t.copy_(flat))
    got = dict(receive_broadcast(None, names=[n for n, _ in ordered], load_format="flattened_bucket",
                                 dtypes=[str(t.dtype).removeprefix("torch.") for _, t in ordered],
                                 shapes=[list(t.shape) for _, t in ordered]))
    for name, tensor in bucket:
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_broadcast_coalesces_buckets_of_small_tensors_on_the_cpu() -> None:
    from megatron_flash.weight_sync.transports.broadcast import COALESCE_MAX_MEAN_BYTES, coalesce

    small = [(f"t{i}", torch.zeros(64)) for i in range(10)]
    large = [(f"t{i}", torch.zeros(COALESCE_MAX_MEAN_BYTES // 4 + 1)) for i in range(3)]  # just above on average
    assert coalesce(small) and not coalesce(large)
    assert not coalesce(small[:1])  # one tensor: nothing to coalesce
    assert coalesce(large[:1] + small * 30)  # one large tensor among many small ones: the mean decides
