"""tests/shm.py: which new /dev/shm names a test owns. A name another process tree holds is not this
test's; a name nobody holds, or one that a descendant of this process holds, is."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from multiprocessing import shared_memory

from tests.shm import leaked_shm, shm_names

# Holds a named segment until its stdin closes; the double fork re-parents it away from pytest, as the
# other xdist worker's processes are.
_DETACHED = """
import os, sys
from multiprocessing import shared_memory
if os.fork():
    os._exit(0)
os.setsid()
seg = shared_memory.SharedMemory(name=sys.argv[1], create=True, size=4096)
print("ready", flush=True)
sys.stdin.read()
seg.close(); seg.unlink()
"""


def _name(tag: str) -> str:
    return f"mf_shm_test_{tag}_{os.getpid()}"


def test_a_segment_nobody_holds_is_a_leak_and_one_held_here_is_ours() -> None:
    before = shm_names()
    held = shared_memory.SharedMemory(name=_name("held"), create=True, size=4096)
    orphan = shared_memory.SharedMemory(name=_name("orphan"), create=True, size=4096)
    orphan.close()  # still named, no process has it open or mapped
    try:
        found = leaked_shm(before, settle_s=0.5)
        assert any(f.startswith(_name("held")) and str(os.getpid()) in f for f in found), found
        assert any(f.startswith(_name("orphan")) and "nobody" in f for f in found), found
    finally:
        held.close()
        held.unlink()
        shared_memory.SharedMemory(name=_name("orphan")).unlink()
    assert not leaked_shm(before)


def test_a_segment_held_by_another_process_tree_is_not_counted() -> None:
    before = shm_names()
    name = _name("other")
    proc = subprocess.Popen([sys.executable, "-c", _DETACHED, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert name in shm_names()
        assert not leaked_shm(before)
    finally:
        proc.stdin.close()  # the detached holder unlinks and exits
        deadline = time.monotonic() + 10
        while name in shm_names() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert name not in shm_names()


def test_a_segment_in_flight_is_not_a_leak_once_it_settles() -> None:
    """Held by nobody for a moment (made by one process, not yet opened by the next), then unlinked by
    its receiver: not counted. Held by nobody for the whole settling time: counted."""
    import threading

    before = shm_names()
    flight = shared_memory.SharedMemory(name=_name("flight"), create=True, size=4096)
    flight.close()
    receiver = threading.Timer(0.5, lambda: shared_memory.SharedMemory(name=_name("flight")).unlink())
    receiver.start()
    try:
        assert not leaked_shm(before, settle_s=5.0)
    finally:
        receiver.join()
    stuck = shared_memory.SharedMemory(name=_name("stuck"), create=True, size=4096)
    stuck.close()
    try:
        started = time.monotonic()
        found = leaked_shm(before, settle_s=1.0)
        assert found == [f"{_name('stuck')} (held by nobody)"] and time.monotonic() - started >= 1.0
    finally:
        shared_memory.SharedMemory(name=_name("stuck")).unlink()
