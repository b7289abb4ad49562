"""Staged ipc on one host: the sender's persistent shared-memory buffers, filled and read alternately.

Why: a fresh shared-memory segment per bucket (what ForkingPickler does with a CPU tensor) faults and
zeroes every page before the copy and the engine maps it again each time: 0.05 of memcpy measured on
the CPU box. Here a sender owns `count` buffers for the life of an engine set; each is an anonymous
memfd (no name in /dev/shm, so a killed process leaves nothing behind), its pages touched once at
creation. `add` copies the bucket's tensors into the free buffer at 64-byte aligned offsets (a tensor
larger than a buffer goes in pieces) and, when the buffer is full, hands it to the engines in a
background request while the next buffer fills; a buffer is written again only after every engine
answered its previous request. The engines map each buffer once (engines/shared_weights.py).

Errors are per engine, first one kept: an engine that failed gets no later buffer of the pass.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import secrets
from typing import Any, Callable, Optional

import torch

from megatron_flash.engines.shared_weights import MEMFD_PREFIX
from megatron_flash.weight_sync.calls import Errors

ALIGN = 64
NUM_BUFFERS = 2
"""Two: one filled by the trainer while the engines copy out of the other."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class SharedBuffers:
    """`count` memfd buffers of `nbytes`, mapped read-write by this process; `close` frees them."""

    def __init__(self, nbytes: int, count: int = NUM_BUFFERS) -> None:
        if nbytes < ALIGN or count < 1:
            raise ValueError(f"shared buffers: need at least one of >= {ALIGN} bytes, got {count} of {nbytes}")
        self.nbytes, self.set_id, self.pid = nbytes, secrets.token_hex(8), os.getpid()
        self.fds: list[int] = []
        self._maps: list[mmap.mmap] = []
        self.tensors: list[torch.Tensor] = []
        try:
            for index in range(count):
                fd = os.memfd_create(f"{MEMFD_PREFIX}-{index}", os.MFD_CLOEXEC)
                self.fds.append(fd)
                os.ftruncate(fd, nbytes)
                self._maps.append(mmap.mmap(fd, nbytes))
                # Touched now, so no sync pays the page faults of a new segment.
                self.tensors.append(torch.frombuffer(self._maps[-1], dtype=torch.uint8).fill_(0))
        except BaseException:
            self.close()
            raise

    def spec(self, index: int) -> dict[str, Any]:
        return {"set": self.set_id, "index": index, "pid": self.pid, "fd": self.fds[index], "nbytes": self.nbytes}

    def close(self) -> None:
        self.tensors = []
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:  # a view is still referenced: the pages go when it does
                pass
        for fd in self.fds:
            os.close(fd)
        self._maps, self.fds = [], []


Deliver = Callable[[dict, list, list, str], Errors]
"""(buffer spec, entries, engine urls, label) → errors by url; runs in the stager's thread."""


class Stager:
    """Packs buckets into the buffers and sends them; `drain` ends a pass (every request answered)."""

    def __init__(self, deliver: Deliver, buffers: SharedBuffers) -> None:
        self.deliver, self.buffers = deliver, buffers
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mf-ipc-stage")
        self._pending: list[Optional[concurrent.futures.Future]] = [None] * len(buffers.tensors)
        self._current, self._used = 0, 0
        self._entries: list[dict[str, Any]] = []
        self._steps: list[str] = []
        self._urls: list[str] = []
        self._failed: Errors = {}
        self._unreported: Errors = {}

    # -------------------------------------------------------------- filling
    def add(self, bucket: list[tuple[str, torch.Tensor]], urls: list[str], step: str) -> Errors:
        """Copy `bucket` in (sending full buffers on the way); returns the errors learned so far."""
        self._urls = [u for u in urls if u not in self._failed]
        for name, tensor in bucket:
            if tensor.numel():
                self._put(name, tensor.detach(), step)
        return self._report()

    def _put(self, name: str, tensor: torch.Tensor, step: str) -> None:
        capacity = self.buffers.nbytes
        itemsize, numel = tensor.element_size(), tensor.numel()
        nbytes = numel * itemsize
        if nbytes <= capacity:
            if self._used + nbytes > capacity:
                self._send_current()
            self._write(name, tensor, tensor, 0, step)
            return
        flat = tensor.reshape(-1)  # larger than a buffer: in pieces of whole elements
        start = 0
        while start < numel:
            if capacity - self._used < itemsize:
                self._send_current()
            count = min(numel - start, (capacity - self._used) // itemsize)
            self._write(name, tensor, flat[start:start + count], start, step)
            start += count

    def _write(self, name: str, whole: torch.Tensor, part: torch.Tensor, start: int, step: str) -> None:
        buffer = self.buffers.tensors[self._current]
        offset, nbytes = self._used, part.numel() * part.element_size()
        buffer[offset:offset + nbytes].view(part.dtype).view(part.shape).copy_(part)  # strided sources too
        self._entries.append({"name": name, "dtype": str(whole.dtype).removeprefix("torch."),
                              "shape": list(whole.shape), "offset": offset, "start": start, "numel": part.numel()})
        if not self._steps or self._steps[-1] != step:
            self._steps.append(step)
        self._used = min(_aligned(offset + nbytes), self.buffers.nbytes)

    # -------------------------------------------------------------- sending
    def _send_current(self) -> None:
        if not self._entries:
            return
        index, entries = self._current, self._entries
        label = self._steps[0] if len(self._steps) == 1 else f"{self._steps[0]} (through {self._steps[-1]})"
        urls = [u for u in self._urls if u not in self._failed]
        spec = self.buffers.spec(index)

        def request() -> Errors:
            return self.deliver(spec, entries, urls, label) if urls else {}

        self._pending[index] = self._pool.submit(request)
        self._entries, self._steps, self._used = [], [], 0
        self._current = (index + 1) % len(self._pending)
        self._wait(self._current)  # the next buffer to fill: its last request must be answered

    def _wait(self, index: int) -> None:
        future, self._pending[index] = self._pending[index], None
        if future is None:
            return
        try:
            errors = future.result()
        except Exception as error:  # the request thread itself failed: every target is partial
            errors = {u: f"trainer: {type(error).__name__}: {error}" for u in self._urls}
        for url, message in errors.items():
            if url not in self._failed:
                self._failed[url] = self._unreported[url] = message

    def _report(self) -> Errors:
        out, self._unreported = self._unreported, {}
        return out

    def drain(self) -> Errors:
        """Send what is staged, wait for every answer; the errors not reported yet. Ends a pass."""
        try:
            self._send_current()
        finally:
            for index in range(len(self._pending)):
                self._wait(index)
            self._entries, self._steps, self._used = [], [], 0
        out = self._report()
        self._failed = {}
        return out

    def close(self) -> None:
        for index in range(len(self._pending)):
            self._wait(index)
        self._pool.shutdown(wait=True)
        self.buffers.close()
