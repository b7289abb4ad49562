"""megatron_flash/memprobe.py: the memory profile a long run writes under MF_MEMPROBE."""

from __future__ import annotations

import csv
import json
import os
import sys
import tracemalloc

import pytest

from megatron_flash import memprobe

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")


class Leaked:
    """Instances kept between two snapshots: the growth the probe must name."""

    def __init__(self, i: int) -> None:
        self.payload = [i] * 64


def test_off_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(memprobe.ENV, raising=False)
    assert memprobe.start_from_env() is None


def test_bad_settings_name_the_variable(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=memprobe.ENV_EVERY):
        memprobe.MemProbe(str(tmp_path), at_minutes=[1.0], every_s=0, frames=1)
    monkeypatch.setenv(memprobe.ENV, str(tmp_path))
    monkeypatch.setenv(memprobe.ENV_AT, "ten")
    with pytest.raises(ValueError, match=memprobe.ENV_AT):
        memprobe.start_from_env()


def test_snapshots_name_what_grew(tmp_path) -> None:
    was_tracing = tracemalloc.is_tracing()
    probe = memprobe.MemProbe(str(tmp_path), at_minutes=[], every_s=3600, frames=1)
    if not was_tracing:
        tracemalloc.start(1)
    try:
        first = json.load(open(probe.snapshot(label="a")))
        kept = [Leaked(i) for i in range(20_000)]
        second = json.load(open(probe.snapshot(label="b", last=True)))
    finally:
        if not was_tracing:
            tracemalloc.stop()
    assert len(kept) == 20_000
    assert "types_growth" not in first and "sites_growth" not in first  # nothing to compare the first with
    assert "malloc_trim" not in first  # a trim only at the last snapshot
    growth = dict((k, v) for k, v in second["types_growth"])
    assert growth.get(f"{__name__}.Leaked", 0) >= 20_000
    assert any("test_memprobe.py" in site for site in second["sites_growth"][:3]), second["sites_growth"][:3]
    for label in ("a", "b"):
        assert os.path.getsize(tmp_path / f"memprobe_{os.getpid()}_{label}.tracemalloc") > 0
    assert second["rss_mb"] > 0 and second["anonymous_mb"] > 0
    if memprobe._LIBC is not None:  # glibc: the heap's numbers, its arenas and what a trim gave back
        assert second["in_use_mb"] > 0 and second["arenas"] >= 1
        assert set(second["malloc_trim"]) == {"rss_before_mb", "rss_after_mb", "released_mb"}
        assert (tmp_path / f"memprobe_{os.getpid()}_b_malloc.xml").read_text().startswith("<malloc")


def test_the_thread_writes_rows_and_the_due_snapshots(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(memprobe.ENV, str(tmp_path))
    monkeypatch.setenv(memprobe.ENV_AT, "0")
    monkeypatch.setenv(memprobe.ENV_EVERY, "0.05")
    monkeypatch.setenv(memprobe.ENV_FRAMES, "0")  # tracemalloc stays off: only the native numbers and counts
    probe = memprobe.start_from_env()
    assert probe is not None
    try:
        snap = tmp_path / f"memprobe_{os.getpid()}_0m.json"
        for _ in range(400):
            rows = list(csv.DictReader(open(probe.csv_path))) if os.path.exists(probe.csv_path) else []
            if snap.exists() and len(rows) >= 3:
                break
            probe._stop.wait(0.05)
    finally:
        probe.stop()
    assert snap.exists() and "sites_top" not in json.load(open(snap))
    assert len(rows) >= 3 and float(rows[-1]["rss_mb"]) > 0 and int(rows[-1]["gc_objects"]) > 1000
    assert not tracemalloc.is_tracing()


@pytest.mark.skipif(memprobe._LIBC is None, reason="glibc's malloc_trim")
def test_heap_trim_gives_free_pages_back() -> None:
    # Holes of 7 freed 2 kB blocks (each spans at least 2 whole pages) between kept ones: free inside the heap, never at its top, so glibc's
    # free() keeps them resident; a trim returns their whole pages.
    blocks = [bytearray(2000) for _ in range(40_000)]
    for b in blocks:
        b[::512] = b"x" * len(b[::512])  # touched: resident
    kept = blocks[::8]
    del blocks
    trim = memprobe.HeapTrim(interval_s=0)
    before = memprobe.smaps()["rss"]
    assert trim.maybe()
    after = memprobe.smaps()["rss"]
    assert before - after >= 20, (before, after)
    assert len(kept) == 5_000 and trim.num_trims == 1


def test_heap_trim_waits_its_interval() -> None:
    trim = memprobe.HeapTrim(interval_s=3600)
    assert not trim.maybe() and trim.num_trims == 0  # the interval counts from construction
    with pytest.raises(ValueError, match="interval_s"):
        memprobe.HeapTrim(interval_s=-1)
