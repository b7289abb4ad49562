"""A memory profile of a long run (`MF_MEMPROBE=<dir>`): where a process's resident memory goes, and what
grows between two moments, Python objects and native memory apart.

    MF_MEMPROBE=runs/mem MF_MEMPROBE_AT=5,12,25 python launch/pretrain_async_rl.py --config ...

Set, the launcher calls `start_from_env()` first thing on every rank; unset, nothing of this module runs
(one environment lookup at start-up). A daemon thread then writes, per process (files carry the pid):

  * every MF_MEMPROBE_EVERY_S seconds (default 60) one row of `memprobe_<pid>.csv`: RSS split into
    anonymous and file-backed pages (/proc/self/smaps_rollup), glibc's heap (`mallinfo2`: bytes in use,
    free inside the heap, mmapped), objects the garbage collector tracks, and
    what tracemalloc traces (and its own overhead, to subtract from RSS);
  * at each minute of MF_MEMPROBE_AT (minutes since start-up, default 10,60) a snapshot
    `memprobe_<pid>_<M>m.json`: the same numbers, Python objects counted by type (top 60), those counts'
    change since the previous snapshot, tracemalloc's top 40 allocation sites and their growth since the
    previous snapshot (also `.tracemalloc` files that `tracemalloc.Snapshot.load` reads), glibc's per-arena
    report (`malloc_info`, as `memprobe_<pid>_<M>m_malloc.xml`), and at the last snapshot what `malloc_trim(0)`
    gave back (RSS before and after: memory free in glibc's heaps but still resident).

MF_MEMPROBE_FRAMES (default 1) is tracemalloc's traceback depth; 0 leaves tracemalloc off, which keeps
the process's speed and RSS as without the probe (tracing costs time per allocation and ~30-50 bytes
per live block), and RSS by tracemalloc's own overhead (a CSV column, to subtract). The trim at the last
snapshot changes what follows it: the CSV rows after it show by how much.
Linux with glibc; elsewhere the native numbers are left empty.

`HeapTrim` is not a probe but what the probe led to: the trainer's loop calls it after every step, and at
most every `interval_s` it hands the pages that are free inside glibc's heaps back to the kernel
(`malloc_trim(0)`). Without it a long run's RSS creeps up while the memory its objects use stays flat:
glibc gives a heap's free memory back only from the heap's top, so each heap (one per arena; the
trainer's threads use up to 8 per core) stays as large as the largest working set it has met
(docs/benchmarks.md, "Soak", has the numbers).
"""

from __future__ import annotations

import collections
import csv
import ctypes
import ctypes.util
import gc
import json
import os
import threading
import time
import tracemalloc
from typing import Any, Optional

ENV, ENV_AT, ENV_EVERY, ENV_FRAMES = "MF_MEMPROBE", "MF_MEMPROBE_AT", "MF_MEMPROBE_EVERY_S", "MF_MEMPROBE_FRAMES"
TOP_TYPES, TOP_SITES = 60, 40
_MB = 1024 * 1024


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # not glibc, or glibc < 2.33 (no mallinfo2)
        return None


_LIBC = _libc()


def smaps() -> dict[str, float]:
    """RSS of this process in MB, split: anonymous (heaps, arenas, anonymous mmaps), file-backed, shmem."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Anonymous", "Shmem", "Swap"):
                    out[key.lower()] = int(rest.split()[0]) / 1024
    except OSError:
        return {}
    out["file"] = out.get("rss", 0.0) - out.get("anonymous", 0.0) - out.get("shmem", 0.0)
    return out


def malloc_stats() -> dict[str, float]:
    """glibc's heap in MB (every arena summed): in use, free but kept inside the heap, mmapped blocks."""
    if _LIBC is None:
        return {}
    m = _LIBC.mallinfo2()
    return {"heap_mb": m.arena / _MB, "in_use_mb": m.uordblks / _MB, "free_in_heap_mb": m.fordblks / _MB,
            "mmapped_mb": m.hblkhd / _MB, "top_pad_mb": m.keepcost / _MB}


def malloc_info(path: str) -> int:
    """glibc's XML report (one <heap> per arena) written to `path`; returns the number of arenas."""
    if _LIBC is None:
        return 0
    libc = _LIBC
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    fp = libc.fopen(path.encode(), b"w")
    if not fp:
        return 0
    try:
        libc.malloc_info(0, fp)
    finally:
        libc.fclose(fp)
    with open(path) as f:
        return f.read().count("<heap nr=")


def trim() -> dict[str, float]:
    """`malloc_trim(0)`: free pages inside glibc's heaps go back to the kernel; RSS before and after."""
    if _LIBC is None:
        return {}
    before = smaps().get("rss", 0.0)
    _LIBC.malloc_trim(0)
    after = smaps().get("rss", 0.0)
    return {"rss_before_mb": before, "rss_after_mb": after, "released_mb": before - after}


def object_counts() -> collections.Counter:
    """Objects the garbage collector tracks, by `module.qualname` of their type."""
    counts: collections.Counter = collections.Counter()
    for o in gc.get_objects():
        t = type(o)
        counts[f"{t.__module__}.{t.__qualname__}"] += 1
    return counts


def light_row(t0: float) -> dict[str, float]:
    row: dict[str, float] = {"time": round(time.time(), 3), "minutes": round((time.monotonic() - t0) / 60, 3)}
    row.update({f"{k}_mb": round(v, 2) for k, v in smaps().items()})
    row.update({k: round(v, 2) for k, v in malloc_stats().items()})
    row["gc_objects"] = len(gc.get_objects())
    row["threads"] = threading.active_count()
    if tracemalloc.is_tracing():
        current, _ = tracemalloc.get_traced_memory()
        row["traced_mb"] = round(current / _MB, 2)
        row["tracemalloc_overhead_mb"] = round(tracemalloc.get_tracemalloc_memory() / _MB, 2)
    return row


class MemProbe:
    """The sampling thread of one process (see the module docstring)."""

    def __init__(self, out_dir: str, *, at_minutes: list[float], every_s: float, frames: int) -> None:
        if every_s <= 0 or any(m < 0 for m in at_minutes) or frames < 0:
            raise ValueError(f"{ENV_EVERY} must be > 0, {ENV_AT} minutes >= 0 and {ENV_FRAMES} >= 0, got "
                             f"{every_s}, {at_minutes}, {frames}")
        self.out_dir, self.at, self.every_s, self.frames = out_dir, sorted(at_minutes), every_s, frames
        self.pid = os.getpid()
        self.t0 = time.monotonic()
        self._prev_counts: Optional[collections.Counter] = None
        self._prev_snap: Optional[tracemalloc.Snapshot] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.csv_path = os.path.join(out_dir, f"memprobe_{self.pid}.csv")

    def start(self) -> "MemProbe":
        os.makedirs(self.out_dir, exist_ok=True)
        if self.frames and not tracemalloc.is_tracing():
            tracemalloc.start(self.frames)
        self._thread = threading.Thread(target=self._run, name="memprobe", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _run(self) -> None:
        todo, next_row = list(self.at), 0.0
        while not self._stop.is_set():
            now = (time.monotonic() - self.t0)
            if now >= next_row:
                self.write_row()
                next_row = now + self.every_s  # after a long snapshot: no burst of rows to catch up
            while todo and now >= todo[0] * 60:
                self.snapshot(label=f"{todo.pop(0):g}m", last=not todo)
            wake = min([next_row] + [m * 60 for m in todo]) - (time.monotonic() - self.t0)
            self._stop.wait(max(wake, 0.05))

    def write_row(self) -> dict[str, float]:
        row = light_row(self.t0)
        new = not os.path.exists(self.csv_path)
        with open(self.csv_path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(row), extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerow(row)
        return row

    def snapshot(self, *, label: str, last: bool = False) -> str:
        """The full snapshot (module docstring), with a trim when `last`; returns the JSON file's path."""
        base = os.path.join(self.out_dir, f"memprobe_{self.pid}_{label}")
        report: dict[str, Any] = {"label": label, **light_row(self.t0)}
        report["arenas"] = malloc_info(base + "_malloc.xml")  # before the counting below allocates
        counts = object_counts()
        report["types_top"] = counts.most_common(TOP_TYPES)
        if self._prev_counts is not None:
            delta = counts.copy()
            delta.subtract(self._prev_counts)
            report["types_growth"] = [(k, v) for k, v in delta.most_common(TOP_TYPES) if v > 0]
        self._prev_counts = counts
        if tracemalloc.is_tracing():
            snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            snap.dump(base + ".tracemalloc")
            report["sites_top"] = [str(s) for s in snap.statistics("lineno")[:TOP_SITES]]
            if self._prev_snap is not None:
                report["sites_growth"] = [str(s) for s in snap.compare_to(self._prev_snap, "lineno")[:TOP_SITES]]
            self._prev_snap = snap
        if last:  # only then: a trim between two snapshots would change the growth they compare
            report["malloc_trim"] = trim()
        with open(base + ".json", "w") as f:
            json.dump(report, f, indent=1)
        return base + ".json"


class HeapTrim:
    """`malloc_trim(0)` at most every `interval_s` seconds, when `maybe()` is called (see the module docstring)."""

    def __init__(self, *, interval_s: float) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.interval_s = interval_s
        self.num_trims = 0
        self._last = time.monotonic()

    def maybe(self) -> bool:
        """Trim if the interval has passed since the last trim (or since construction); True if it did."""
        now = time.monotonic()
        if _LIBC is None or now - self._last < self.interval_s:
            return False
        _LIBC.malloc_trim(0)
        self._last = time.monotonic()
        self.num_trims += 1
        return True


def start_from_env() -> Optional[MemProbe]:
    """The probe, started, when MF_MEMPROBE names a directory; None (and nothing else done) otherwise."""
    out_dir = os.environ.get(ENV, "")
    if not out_dir:
        return None
    try:
        at = [float(m) for m in os.environ.get(ENV_AT, "10,60").split(",") if m.strip()]
        every_s, frames = float(os.environ.get(ENV_EVERY, "60")), int(os.environ.get(ENV_FRAMES, "1"))
    except ValueError as error:
        raise ValueError(f"{ENV_AT} (comma-separated minutes), {ENV_EVERY} (seconds) and {ENV_FRAMES} (an int): "
                         f"{error}") from None
    return MemProbe(out_dir, at_minutes=at, every_s=every_s, frames=frames).start()
