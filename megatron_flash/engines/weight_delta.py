"""Delta weight updates: the wire format, the checksum, and the engine's side (`DeltaReceiver`).

A push with `weight_sync.delta` carries ordinary named tensors, so every transport (ipc, broadcast,
disk) moves it unchanged; reserved names say what they are. For a HF tensor `N` (values in the
engine's dtype):

    N               the whole tensor (the first push, an anchor, a dense change)
    N::mf.idx       int32 (int64 past 2**31 elements) flat positions of the changed values, ascending
    N::mf.mask      uint8, bit b of byte j set = element 8·j + b changed (least significant bit first)
    N::mf.zidx      uint8: the gaps' width (2 or 4), then zlib of the positions' gaps (the first from -1)
                    as little-endian uint16 or int32, where that is smaller than both of the above by a
                    fifth (`compress_positions`)
    N::mf.val       the new values at those positions, in order
    N::mf.sum       int64 [2], `checksum` of N's bytes after the push: present for every tensor of the push
    mf.delta.base   int64 [1], the version this delta applies to (every bucket of a delta push)

The engine applies a delta only when it serves `mf.delta.base`; it refuses otherwise (the bridge then
sends it everything). After the last bucket, the final call (`update_weight_version`, or the disk load
itself, with `verify_tensors`: how many tensors the trainer sent) checks that that many tensors came
with a checksum in this push and that each equals the checksum of the engine's bytes; any miss fails
the update, so the version is not advanced and the bridge re-sends the whole model. An engine either verifies or does not serve.
"""

from __future__ import annotations

import os
import zlib
from typing import Callable, Optional

import numpy as np
import torch

FAULT_ENV = "MF_FAULT_DELTA_DIR"
"""Tests and benchmarks: a file `<dir>/<engine pid>` holding `drop` or `corrupt` makes that engine lose
(or flip a bit of) the delta parts of the next request that carries some, then removes the file."""

SEP = "::mf."
BASE = "mf.delta.base"
KINDS = ("idx", "mask", "zidx", "val", "sum")
ROW_WORDS = 256


def part_name(name: str, kind: str) -> str:
    return f"{name}{SEP}{kind}"


def split_name(name: str) -> tuple[str, str]:
    """('N', kind) for a reserved name, (name, '') otherwise."""
    if SEP in name:
        base, kind = name.rsplit(SEP, 1)
        if kind not in KINDS:
            raise ValueError(f"{name!r}: unknown delta part {kind!r} (known: {', '.join(KINDS)})")
        return base, kind
    return name, ""


def is_delta_part(name: str) -> bool:
    return name == BASE or SEP in name


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 words of the tensor's bytes, on its device: the sum of its 64-bit words, and the sum
    of each 256-word row's sum times the row's index + 1 (a value moved between rows changes it).
    Integer sums wrap modulo 2**64, so the order of the additions (device, threads) never matters.
    ~16 GB/s on one CPU thread; a few ops on a GPU."""
    flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
    whole = flat.numel() // 8 * 8
    words = flat[:whole].view(torch.int64)
    tail = flat[whole:]
    if tail.numel():  # the last < 8 bytes, zero-padded into one more word
        pad = torch.zeros(8, dtype=torch.uint8, device=flat.device)
        pad[:tail.numel()] = tail
        words = torch.cat([words, pad.view(torch.int64)])
    rows = words.numel() // ROW_WORDS
    s0 = words.sum()
    head = words[:rows * ROW_WORDS].view(rows, ROW_WORDS).sum(dim=1)
    weights = torch.arange(1, rows + 1, dtype=torch.int64, device=flat.device)
    s1 = (head * weights).sum() + words[rows * ROW_WORDS:].sum() * (rows + 1)
    return torch.stack([s0, s1])


def int_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its element size (a bitwise compare of floats: -0.0 ≠ 0.0, NaN == NaN)."""
    by_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.view(by_size[tensor.element_size()])


def pack_mask(changed: torch.Tensor) -> torch.Tensor:
    """A flat bool tensor → uint8 bits, least significant bit first (numel padded to a multiple of 8)."""
    n = changed.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=changed.device)
    padded[:n] = changed.view(-1).to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=changed.device)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_mask(mask: torch.Tensor, numel: int) -> torch.Tensor:
    """uint8 bits → flat positions (int64) of the set bits among the first `numel` elements."""
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    bits = (mask.view(-1, 1) >> shifts) & 1
    return bits.view(-1)[:numel].nonzero().view(-1)


def compress_positions(positions: torch.Tensor) -> bytes:
    """Ascending flat positions → one byte (2 or 4: the gaps' width) + zlib (level 1) of their gaps
    as little-endian uint16 (when every gap fits) or int32: small gaps, few distinct bytes."""
    gaps = torch.diff(positions.to("cpu", torch.int64), prepend=torch.tensor([-1]))
    narrow = bool(gaps.numel()) and int(gaps.max()) < 2**16
    data = gaps.numpy().astype("<u2" if narrow else "<i4").tobytes()
    return bytes([2 if narrow else 4]) + zlib.compress(data, 1)


def decompress_positions(data: torch.Tensor) -> torch.Tensor:
    raw = data.to("cpu").numpy().tobytes()
    if not raw or raw[0] not in (2, 4):
        raise ValueError("compressed delta positions: the first byte must be the gaps' width, 2 or 4")
    gaps = np.frombuffer(zlib.decompress(raw[1:]), dtype="<u2" if raw[0] == 2 else "<i4").astype(np.int64)
    return torch.from_numpy(np.cumsum(gaps) - 1)


def apply_delta(target: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """Write `values` at flat `positions` of `target` in place (same dtype: bits are copied as they are)."""
    if values.dtype != target.dtype:
        raise ValueError(f"delta values are {values.dtype}, the served tensor is {target.dtype}: "
                         "engines.dtype must be the engine's dtype")
    if not target.is_contiguous():
        raise ValueError("the served tensor is not contiguous")
    flat = target.view(-1)
    if positions.numel() != values.numel():
        raise ValueError(f"{positions.numel()} positions but {values.numel()} values")
    if positions.numel() and int(positions.max()) >= flat.numel():
        raise ValueError(f"a position past the tensor's {flat.numel()} elements")
    flat[positions.to(device=flat.device, dtype=torch.int64)] = values.to(flat.device)


class DeltaReceiver:
    """One engine's state for the push in progress: the checksums it was told, the delta parts that
    have not met their partner yet. `resolve(name)` → the served tensor for a HF name (or None);
    `version()` → the version the engine serves now."""

    def __init__(self, resolve: Callable[[str], Optional[torch.Tensor]], version: Callable[[], str]) -> None:
        self.resolve, self.version = resolve, version
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.parts: dict[str, dict[str, torch.Tensor]] = {}
        self.seen = False
        self.applied = 0
        self.changed = 0

    def take(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Consume the delta parts of `named` (applying every delta that is complete); the plain
        tensors are returned for the engine to copy as usual."""
        plain = []
        named = self._inject_fault(named)
        for name, tensor in named:
            if not is_delta_part(name):
                plain.append((name, tensor))
                continue
            self.seen = True
            if name == BASE:
                base = str(int(tensor.view(-1)[0]))
                if base != self.version():
                    raise ValueError(f"delta refused: it applies to weight_version {base!r}, this engine serves "
                                     f"{self.version()!r} (the trainer must send every weight)")
                continue
            target_name, kind = split_name(name)
            if kind == "sum":
                self.sums[target_name] = tensor.detach().to("cpu", torch.int64).clone().view(-1)
                continue
            parts = self.parts.setdefault(target_name, {})
            parts[kind] = tensor.detach().clone() if not tensor.is_cuda else tensor.detach()
            if "val" in parts and ("idx" in parts or "mask" in parts or "zidx" in parts):
                self._apply(target_name, self.parts.pop(target_name))
        return plain

    @staticmethod
    def _inject_fault(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        folder = os.environ.get(FAULT_ENV)
        path = os.path.join(folder, str(os.getpid())) if folder else ""
        if not path or not os.path.exists(path):
            return named
        with open(path) as f:
            fault = f.read().strip()
        os.remove(path)
        if fault == "drop":
            return [(n, t) for n, t in named if not is_delta_part(n)]
        kinds = [split_name(n)[1] for n, _ in named]
        pick = kinds.index("val") if "val" in kinds else kinds.index("sum")
        named = list(named)
        name, tensor = named[pick]
        tensor = tensor.clone()
        tensor.view(-1).view(torch.uint8)[0] ^= 1
        named[pick] = (name, tensor)
        return named

    def _apply(self, name: str, parts: dict[str, torch.Tensor]) -> None:
        target = self.resolve(name)
        if target is None:
            raise ValueError(f"delta for unknown parameter {name!r}")
        if "idx" in parts:
            positions = parts["idx"].view(-1).to(torch.int64)
        elif "zidx" in parts:
            positions = decompress_positions(parts["zidx"].view(-1))
        else:
            positions = unpack_mask(parts["mask"], target.numel())
        with torch.no_grad():
            apply_delta(target, positions, parts["val"].view(-1))
        self.applied += 1
        self.changed += positions.numel()

    def finish(self, expected: int) -> str:
        """After the push's last bucket: '' when the `expected` number of tensors (the whole model, as the
        trainer counted it) came with checksums and each matches the engine's bytes, else what failed
        (the caller refuses the version). State is reset either way."""
        try:
            problems = []
            if self.parts:
                problems.append(f"{len(self.parts)} delta(s) incomplete (e.g. {sorted(self.parts)[0]!r})")
            if len(self.sums) != expected:
                problems.append(f"checksums for {len(self.sums)} tensor(s) in this push, the trainer sent "
                                f"{expected}: a bucket was lost")
            bad = []
            for name, expected in self.sums.items():
                target = self.resolve(name)
                if target is None:
                    problems.append(f"checksum for unknown parameter {name!r}")
                    continue
                if not torch.equal(checksum(target).cpu(), expected):
                    bad.append(name)
            if bad:
                problems.append(f"checksum mismatch on {len(bad)} tensor(s) (e.g. {bad[0]!r})")
            return "; ".join(problems)
        finally:
            self.reset()
