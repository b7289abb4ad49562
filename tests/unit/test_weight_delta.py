"""Delta weight sync's pure pieces: the checksum, the bitmask, the sender's encoder against the engine's
receiver (engines/weight_delta.py, weight_sync/delta.py), with expected values computed independently
(Python integers, numpy's packbits, a direct cast of the trainer's weights)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from megatron_flash.engines.weight_delta import (BASE, DeltaReceiver, checksum, pack_mask, part_name, split_name,
                                                 unpack_mask)
from megatron_flash.weight_sync.delta import DeltaEncoder


def reference_checksum(tensor: torch.Tensor) -> list[int]:
    data = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    data += b"\0" * (-len(data) % 8)
    words = list(struct.unpack(f"<{len(data) // 8}q", data))
    rows = len(words) // 256
    s0 = sum(words)
    s1 = sum((r + 1) * sum(words[r * 256:(r + 1) * 256]) for r in range(rows)) + (rows + 1) * sum(words[rows * 256:])

    def wrap(v: int) -> int:
        v %= 2**64
        return v - 2**64 if v >= 2**63 else v
    return [wrap(s0), wrap(s1)]


@pytest.mark.parametrize("numel,dtype", [(1, torch.bfloat16), (3, torch.bfloat16), (1021, torch.bfloat16),
                                         (5000, torch.float32), (77, torch.float16), (256 * 4 * 3, torch.bfloat16)])
def test_checksum_is_the_wrapped_word_sums(numel: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(numel)
    tensor = (torch.randn(numel, generator=gen) * 1e4).to(dtype)
    assert checksum(tensor).tolist() == reference_checksum(tensor)


def test_checksum_sees_a_single_bit_and_a_move_between_rows() -> None:
    tensor = torch.randn(4096).to(torch.bfloat16)
    flipped = tensor.clone()
    flipped.view(torch.int16)[17] ^= 1
    assert not torch.equal(checksum(tensor), checksum(flipped))
    moved = tensor.clone()  # two values swapped across 256-word rows: the plain sum cannot see it
    a, b = 3, 3 + 4 * 256 * 2
    moved[a], moved[b] = tensor[b], tensor[a]
    assert tensor[a] != tensor[b]
    assert checksum(tensor)[0] == checksum(moved)[0] and checksum(tensor)[1] != checksum(moved)[1]


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 1000])
def test_the_bitmask_is_numpys_little_endian_packbits(numel: int) -> None:
    changed = torch.rand(numel, generator=torch.Generator().manual_seed(numel)) < 0.3
    mask = pack_mask(changed)
    assert mask.numpy().tolist() == np.packbits(changed.numpy(), bitorder="little").tolist()
    assert unpack_mask(mask, numel).tolist() == np.flatnonzero(changed.numpy()).tolist()


def test_reserved_names() -> None:
    assert split_name(part_name("model.norm.weight", "idx")) == ("model.norm.weight", "idx")
    assert split_name("model.norm.weight") == ("model.norm.weight", "")
    with pytest.raises(ValueError, match="unknown delta part 'zip'"):
        split_name("w::mf.zip")


class Engine:
    """An engine's tensors in bf16 and a receiver over them (what the local engine does per push)."""

    def __init__(self, names: dict[str, torch.Tensor]) -> None:
        self.weights = {n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in names.items()}
        self.version = "default"
        self.receiver = DeltaReceiver(self.weights.get, lambda: self.version)

    def push(self, bucket: list, version: int, expected: int) -> str:
        plain = self.receiver.take(bucket)
        for name, tensor in plain:
            self.weights[name].copy_(tensor)
        problem = self.receiver.finish(expected)
        if not problem:
            self.version = str(version)
        return problem


def trainer_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(300, 16, generator=gen), "norm": torch.ones(16), "w": torch.randn(64, 64, generator=gen)}


def adam_like_step(weights: dict[str, torch.Tensor], lr: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in weights.values():
        t.add_(torch.randn(t.shape, generator=gen).sign() * lr)


def test_deltas_keep_the_engine_bit_identical_to_a_direct_cast() -> None:
    weights = trainer_weights()
    encoder = DeltaEncoder(torch.bfloat16)
    engine = Engine(weights)
    bucket = encoder.encode(list(weights.items()), "full")
    assert engine.push(bucket, 0, 3) == ""
    encoder.commit(0)
    for version, lr in enumerate([1e-6, 1e-5, 1e-4, 1e-3, 1e-1], start=1):
        before = {n: t.to(torch.bfloat16) for n, t in weights.items()}
        adam_like_step(weights, lr, version)
        changed = sum(int((t.to(torch.bfloat16).view(torch.int16) != before[n].view(torch.int16)).sum())
                      for n, t in weights.items())
        encoder.start_pass()
        bucket = encoder.encode(list(weights.items()), "delta", base=version - 1)
        assert engine.push(bucket, version, 3) == "", version
        encoder.commit(version)
        for name, t in weights.items():  # bit-identical to a full push of the bf16 cast
            assert torch.equal(engine.weights[name].view(torch.int16), t.to(torch.bfloat16).view(torch.int16)), name
        whole = [n for n, _ in bucket if n in weights]  # dense tensors count every element as changed
        assert encoder.stats.changed == changed + sum(int((weights[n].to(torch.bfloat16).view(torch.int16) ==
                                                           before[n].view(torch.int16)).sum()) for n in whole)
    assert engine.version == "5"


def test_the_encoding_follows_the_density() -> None:
    weights = {"w": torch.randn(4096)}
    encoder = DeltaEncoder(torch.bfloat16, max_density=0.5)
    encoder.encode(list(weights.items()), "full")
    encoder.commit(0)
    before = weights["w"].to(torch.bfloat16)

    def push(where: torch.Tensor, version: int) -> dict:
        weights["w"][where] += weights["w"][where].abs() * 0.1 + 1e-3  # changes every one of them in bf16
        encoder.start_pass()
        out = dict(encoder.encode(list(weights.items()), "delta", base=version - 1))
        encoder.commit(version)
        return out

    spread = torch.randperm(4096, generator=torch.Generator().manual_seed(1))
    sparse = push(spread[:10], 1)  # 10 × 4 B of positions < 512 B of mask; too few to try zlib
    assert sparse[part_name("w", "idx")].dtype == torch.int32
    assert sparse[part_name("w", "idx")].tolist() == sorted(spread[:10].tolist())
    assert encoder.stats.changed == 10 and encoder.stats.elements == 4096
    assert int((weights["w"].to(torch.bfloat16).view(torch.int16) != before.view(torch.int16)).sum()) == 10
    medium = push(spread[:1000], 2)  # random gaps: 512 B of mask beats 4000 B of positions and their zlib
    assert part_name("w", "mask") in medium and medium[part_name("w", "val")].numel() == 1000
    run = push(torch.arange(1000, 1900), 3)  # a run of 900: its gaps are all 1, zlib wins
    assert part_name("w", "zidx") in run and run[part_name("w", "zidx")].numel() < 100
    dense = push(torch.arange(4096)[:3000], 4)  # 73 % > max_density: whole
    assert "w" in dense and dense["w"].dtype == torch.bfloat16 and encoder.stats.whole == 1
    quiet = push(torch.tensor([], dtype=torch.int64), 5)
    assert list(quiet) == [BASE, part_name("w", "sum")]


def test_the_receiver_refuses_another_base_a_lost_bucket_and_wrong_bytes() -> None:
    weights = trainer_weights()
    encoder = DeltaEncoder(torch.bfloat16)
    engine = Engine(weights)
    assert engine.push(encoder.encode(list(weights.items()), "full"), 0, 3) == ""
    encoder.commit(0)
    adam_like_step(weights, 1e-2, 1)
    bucket = encoder.encode(list(weights.items()), "delta", base=0)
    stale = Engine(weights)  # never got version 0
    with pytest.raises(ValueError, match="delta refused: it applies to weight_version '0', this engine serves 'default'"):
        stale.push(bucket, 1, 3)
    lost = [(n, t) for n, t in bucket if not n.startswith("norm")]  # the bucket with "norm" never arrived
    assert "checksums for 2 tensor(s) in this push, the trainer sent 3: a bucket was lost" in engine.push(lost, 1, 3)
    assert engine.version == "0"
    corrupt = [(n, t.clone()) for n, t in bucket]
    hit = [n for n, _ in corrupt if split_name(n)[0] == "embed" and split_name(n)[1] in ("", "val")]
    assert len(hit) == 1, [n for n, _ in corrupt]
    for name, t in corrupt:
        if name == hit[0]:
            t.view(torch.int16)[0] ^= 4
    problem = engine.push(corrupt, 1, 3)
    assert "checksum mismatch on 1 tensor(s) (e.g. 'embed')" in problem and engine.version == "0"


def test_a_full_push_repairs_what_a_delta_broke() -> None:
    weights = trainer_weights()
    encoder = DeltaEncoder(torch.bfloat16)
    engine = Engine(weights)
    engine.push(encoder.encode(list(weights.items()), "full"), 0, 3)
    encoder.commit(0)
    engine.weights["norm"][5] = 123.0  # drift in a tensor this step leaves as it is: only the checksum sees it
    adam_like_step(weights, 1e-3, 1)
    assert "checksum mismatch" in engine.push(encoder.encode(list(weights.items()), "delta", base=0), 1, 3)
    assert engine.push(encoder.encode(list(weights.items()), "full"), 1, 3) == ""
    for name, t in weights.items():
        assert torch.equal(engine.weights[name].view(torch.int16), t.to(torch.bfloat16).view(torch.int16))


def test_an_encoder_refuses_a_delta_against_a_base_it_does_not_hold() -> None:
    encoder = DeltaEncoder(torch.bfloat16)
    with pytest.raises(ValueError, match="a delta against version 3 but the kept copy holds None"):
        encoder.encode([("w", torch.zeros(4))], "delta", base=3)
    with pytest.raises(ValueError, match="max_density must be in"):
        DeltaEncoder(torch.bfloat16, max_density=0)


def test_positions_are_compressed_where_it_pays_and_decoded_exactly() -> None:
    from megatron_flash.engines.weight_delta import compress_positions, decompress_positions

    gen = torch.Generator().manual_seed(7)
    positions = torch.sort(torch.randperm(2_000_000, generator=gen)[:20_000]).values
    assert decompress_positions(torch.frombuffer(bytearray(compress_positions(positions)), dtype=torch.uint8)).tolist() \
        == positions.tolist()
    weights = {"w": torch.randn(2_000_000, generator=gen)}
    encoder = DeltaEncoder(torch.bfloat16)
    engine = Engine(weights)
    engine.push(encoder.encode(list(weights.items()), "full"), 0, 1)
    encoder.commit(0)
    weights["w"][positions] += weights["w"][positions].abs() * 0.1 + 1e-3  # 1 % changed, sorted gaps ~100
    encoder.start_pass()
    bucket = dict(encoder.encode(list(weights.items()), "delta", base=0))
    assert part_name("w", "zidx") in bucket and encoder.stats.compressed == 1
    # the gaps (≈ 100, one or two bytes of entropy each) shrink well below int32 positions (80 kB)
    assert bucket[part_name("w", "zidx")].numel() * 5 <= 4 * 20_000 * 4
    assert engine.push(list(bucket.items()), 1, 1) == ""
    assert torch.equal(engine.weights["w"].view(torch.int16), weights["w"].to(torch.bfloat16).view(torch.int16))
