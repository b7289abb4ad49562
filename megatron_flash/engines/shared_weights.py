"""The receiving side of the bridge's staged ipc transport (weight_sync/transports/shared_buffers.py).

The trainer owns a small set of anonymous shared-memory files (memfd) and fills them with weight
bytes; a request names one of them by (trainer pid, fd number), which the engine opens once through
/proc/<pid>/fd/<fd> and keeps mapped for every later sync of the same set. There is no name in
/dev/shm at any time, so a process killed at any moment leaves nothing behind: the pages go away when
the last file descriptor and the last mapping are gone. A request whose set differs from the mapped one
drops the old set's mappings first (the trainer made a new set because its engines changed).

Request body (POST /update_weights_from_shared_memory, inside a weight-update session):

    {"buffer": {"set": str, "index": int, "pid": int, "fd": int, "nbytes": int},
     "tensors": [{"name", "dtype", "shape", "offset", "start", "numel"}, ...],
     "weight_version": str | null, "flush_cache": bool}

Each entry is `numel` elements of tensor `name` (full shape `shape`) starting at flat element `start`,
stored at byte `offset` of the buffer: a tensor larger than a buffer arrives in pieces, one per request.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import threading
import warnings
from typing import Any

import torch

MEMFD_PREFIX = "mf-weights"
"""Name the trainer gives its memfd files; the engine refuses a file descriptor that is anything else."""

_FIELDS = ("name", "dtype", "shape", "offset", "start", "numel")


@dataclasses.dataclass
class Piece:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    source: torch.Tensor
    """`numel` elements of `dtype`, a view of the mapped buffer."""


def _dtype(value: Any, where: str) -> torch.dtype:
    dtype = getattr(torch, str(value), None) if isinstance(value, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: dtype {value!r} is not a torch dtype name")
    return dtype


def _int(value: Any, where: str, key: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


class SharedBufferMaps:
    """The buffers of one trainer set, mapped read-only once each."""

    def __init__(self) -> None:
        self._set: str | None = None
        self._maps: dict[int, tuple[mmap.mmap, torch.Tensor]] = {}
        self._lock = threading.Lock()

    @property
    def mapped(self) -> int:
        return len(self._maps)

    def buffer(self, spec: Any) -> torch.Tensor:
        if not isinstance(spec, dict):
            raise ValueError(f"buffer must be an object with set, index, pid, fd, nbytes; got {spec!r}")
        missing = [k for k in ("set", "index", "pid", "fd", "nbytes") if k not in spec]
        if missing:
            raise ValueError(f"buffer: missing field(s) {', '.join(missing)}")
        set_id, index = str(spec["set"]), _int(spec["index"], "buffer", "index")
        pid, fd = _int(spec["pid"], "buffer", "pid", minimum=1), _int(spec["fd"], "buffer", "fd")
        nbytes = _int(spec["nbytes"], "buffer", "nbytes", minimum=1)
        with self._lock:
            if set_id != self._set:
                self.close()
                self._set = set_id
            if index not in self._maps:
                self._maps[index] = _map(pid, fd, nbytes)
            tensor = self._maps[index][1]
        if tensor.numel() != nbytes:
            raise ValueError(f"buffer {index} of set {set_id}: {nbytes} bytes announced, {tensor.numel()} mapped")
        return tensor

    def pieces(self, body: dict) -> list[Piece]:
        """Every entry of a request checked (names resolve later) and turned into views of its buffer."""
        buffer = self.buffer(body.get("buffer"))
        entries = body.get("tensors")
        if not isinstance(entries, list) or not entries:
            raise ValueError("tensors must be a non-empty list of {name, dtype, shape, offset, start, numel}")
        out = []
        for i, entry in enumerate(entries):
            where = f"tensors[{i}]"
            if not isinstance(entry, dict) or any(k not in entry for k in _FIELDS):
                raise ValueError(f"{where}: needs the fields {', '.join(_FIELDS)}; got {entry!r}")
            name, dtype = str(entry["name"]), _dtype(entry["dtype"], f"{where} ({entry['name']})")
            shape = entry["shape"]
            if not isinstance(shape, list) or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape):
                raise ValueError(f"{where} ({name}): shape must be a list of non-negative integers, got {shape!r}")
            offset, start = _int(entry["offset"], where, "offset"), _int(entry["start"], where, "start")
            numel = _int(entry["numel"], where, "numel", minimum=1)
            if start + numel > math.prod(shape):
                raise ValueError(f"{where} ({name}): elements {start}..{start + numel} beyond its shape {shape}")
            end = offset + numel * dtype.itemsize
            if offset % dtype.itemsize or end > buffer.numel():
                raise ValueError(f"{where} ({name}): bytes {offset}..{end} not aligned or beyond the buffer "
                                 f"({buffer.numel()} bytes)")
            out.append(Piece(name, dtype, tuple(shape), start, buffer[offset:end].view(dtype)))
        return out

    def close(self) -> None:
        mms = [mm for mm, _ in self._maps.values()]
        self._maps, self._set = {}, None  # drops the tensors, so their buffer exports end
        for mm in mms:
            try:
                mm.close()
            except BufferError:  # a view is still referenced somewhere: the GC unmaps it later
                pass


def _map(pid: int, fd: int, nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    path = f"/proc/{pid}/fd/{fd}"
    try:
        target = os.readlink(path)
    except OSError as error:
        raise ValueError(f"buffer {path}: cannot be opened ({error.strerror}): the trainer process is gone or "
                         "on another host (ipc needs engines on the trainer's host)") from None
    if not target.startswith(f"/memfd:{MEMFD_PREFIX}"):
        raise ValueError(f"buffer {path} is {target!r}, not a {MEMFD_PREFIX} shared-memory file")
    handle = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(handle).st_size
        if size < nbytes:
            raise ValueError(f"buffer {path}: {nbytes} bytes announced, the file has {size}")
        # MAP_POPULATE: the page tables are built in one go (faulting 4 KB at a time took ~0.7 s per 256 MB)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(handle, nbytes, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(handle)  # the mapping keeps the pages alive, not the descriptor
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: the engine only reads it
        tensor = torch.frombuffer(mm, dtype=torch.uint8)
    return mm, tensor


def copy_pieces(pieces: list[Piece], resolve: Any) -> None:
    """Copy every piece into the served tensor `resolve(name)` (checked first, written after)."""
    plans = []
    for piece in pieces:
        target = resolve(piece.name)
        if target is None:
            raise ValueError(f"unknown parameter {piece.name!r}")
        if tuple(target.shape) != piece.shape:
            raise ValueError(f"shape of {piece.name}: got {piece.shape}, model has {tuple(target.shape)}")
        if not target.is_contiguous():
            raise ValueError(f"{piece.name}: the served tensor is not contiguous")
        plans.append(target)
    with torch.no_grad():
        for target, piece in zip(plans, pieces):
            flat = target.view(-1)[piece.start:piece.start + piece.source.numel()]
            flat.copy_(piece.source)
