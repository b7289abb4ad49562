"""Named shared memory left behind, told apart from another test's: `make test` runs two pytest workers,
so /dev/shm may gain names the other worker's processes hold while a test here runs.

    before = shm_names()
    ...                                   # the test: its processes start, fail, are killed, exit
    assert not leaked_shm(before)         # [] or the names, each with who holds it

A name that appeared since `before` is this test's when no live process holds it (nobody can free it
any more: a leak, whoever made it) or when a process that holds it descends from this one (pytest
started it, directly or not). Names held only by processes outside this tree belong to the other
worker's running tests and are not counted. A name held by nobody is counted only once it has stayed
so for a settling time: torch's file_system segments pass through that state while in flight between
the other worker's trainer and engine (a one-shot check counted one of them, 2026-12-02).
"""

from __future__ import annotations

import os
import time

SHM = "/dev/shm"


def shm_names() -> set[str]:
    return set(os.listdir(SHM))


def _parents() -> dict[int, int]:
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # pid (comm) state ppid ...: comm may hold spaces and parentheses; split after the last ')'
                out[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return out


def _holders(names: set[str]) -> dict[str, set[int]]:
    """name -> pids that have /dev/shm/name open or mapped."""
    paths = {os.path.join(SHM, n): n for n in names}
    found: dict[str, set[int]] = {n: set() for n in names}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            for fd in os.listdir(f"/proc/{entry}/fd"):
                target = os.readlink(f"/proc/{entry}/fd/{fd}").removesuffix(" (deleted)")
                if target in paths:
                    found[paths[target]].add(pid)
            with open(f"/proc/{entry}/maps") as f:
                for line in f:
                    target = line.rstrip("\n").split(maxsplit=5)[-1].removesuffix(" (deleted)")
                    if target in paths:
                        found[paths[target]].add(pid)
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


def _descends(pid: int, root: int, parents: dict[int, int]) -> bool:
    seen = set()
    while pid and pid not in seen:
        if pid == root:
            return True
        seen.add(pid)
        pid = parents.get(pid, 0)
    return False


def leaked_shm(before: set[str], *, settle_s: float = 10.0) -> list[str]:
    """Names in /dev/shm now, not in `before`, that are this test's (module docstring). A name nobody
    holds may be in flight between two of the other worker's processes (torch's file_system sharing:
    made by the sender, opened by the receiver a moment later): it counts only if it is still there,
    and still held by nobody, after up to `settle_s` seconds."""
    new = shm_names() - before
    if not new:
        return []
    holders, parents, me = _holders(new), _parents(), os.getpid()
    ours, unheld = [], set()
    for name in sorted(new):
        if not os.path.exists(os.path.join(SHM, name)):
            continue  # unlinked meanwhile
        pids = holders[name]
        mine = sorted(p for p in pids if _descends(p, me, parents))
        if mine:
            ours.append(f"{name} (held by {mine})")
        elif not pids:
            unheld.add(name)
    deadline = time.monotonic() + settle_s
    while unheld and time.monotonic() < deadline:
        time.sleep(0.25)
        holders = _holders(unheld)
        unheld = {n for n in unheld if os.path.exists(os.path.join(SHM, n)) and not holders[n]}
    return ours + [f"{name} (held by nobody)" for name in sorted(unheld)]
