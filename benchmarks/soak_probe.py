"""What benchmarks/soak.py samples: the resources of a run's whole process tree, read from /proc.

A sample walks the tree under the trainer (every thread's `children` file, recursively) and reads for
each process its role (from its command line), RSS, threads and open file descriptors, plus which
shared-memory objects it holds (fds and mappings under /dev/shm, memfds); and machine-wide, the
entries of /dev/shm. Every process ever seen is remembered with its start time, so that at the end
`survivors()` names each one still alive: an orphan (an engine has a session of its own, so it would
outlive its trainer unseen by a plain `ps --forest` of the trainer). Linux only.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Optional

ROLES = ("trainer", "engine", "reward_worker", "rollout_process", "mp_tracker", "trainer_fork", "other")


@dataclass
class Proc:
    pid: int
    role: str
    rss_mb: float
    threads: int
    fds: int
    shm: set[str] = field(default_factory=set)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _start_time(pid: int) -> Optional[int]:
    """The kernel's start time of `pid` (clock ticks since boot): a pid reused later differs in it."""
    try:
        fields = _read(f"/proc/{pid}/stat").rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[19]) if fields[0] != "Z" else None  # a zombie is dead; only its parent's wait is missing


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                out += [int(c) for c in _read(f"/proc/{pid}/task/{tid}/children").split()]
            except OSError:
                pass  # the thread ended between listing and reading
    except OSError:
        pass
    return out


def tree(root: int) -> list[int]:
    """root and every descendant, parents first."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo += children(pid)
    return out


def role(pid: int, root: int, root_cmdline: str, rollout_process: bool) -> str:
    try:
        cmd = _read(f"/proc/{pid}/cmdline").replace("\0", " ")
    except OSError:
        return "other"
    if pid == root:
        return "trainer"
    if "megatron_flash.engines.local_server" in cmd:
        return "engine"
    if "multiprocessing.resource_tracker" in cmd:
        return "mp_tracker"
    if "multiprocessing.spawn" in cmd:
        # rollout.runner=process: the rollout process is the trainer's one spawned child that has spawned
        # children (its reward workers) or, without workers, the only one; reward workers otherwise.
        return "rollout_process" if rollout_process and children(pid) else "reward_worker"
    if cmd == root_cmdline:
        return "trainer_fork"  # e.g. Megatron's checkpoint writer processes
    return "other"


def _shm_objects(pid: int) -> set[str]:
    """Shared-memory objects the process holds: open fds and mappings of /dev/shm files and memfds."""
    held: set[str] = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(("/dev/shm/", "/memfd:")):
                held.add(target.replace(" (deleted)", ""))
        for line in _read(f"/proc/{pid}/maps").splitlines():
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith(("/dev/shm/", "/memfd:")):
                held.add(parts[5].replace(" (deleted)", ""))
    except OSError:
        pass
    return held


def read_proc(pid: int, role_name: str) -> Optional[Proc]:
    try:
        status = dict(line.split(":", 1) for line in _read(f"/proc/{pid}/status").splitlines() if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None  # it ended while being read
    rss_kb = int(status.get("VmRSS", "0 kB").split()[0])
    return Proc(pid, role_name, rss_kb / 1024, int(status["Threads"]), fds, _shm_objects(pid))


class TreeProbe:
    """Samples the tree under the current trainer pid (`root`, replaced after a resume)."""

    def __init__(self, *, rollout_process: bool) -> None:
        self.rollout_process = rollout_process
        self.seen: dict[tuple[int, int], str] = {}  # (pid, start time) → role, every process ever sampled
        self.shm_at_start = set(os.listdir("/dev/shm"))

    def sample(self, root: int) -> dict[str, float]:
        """One row: per role the process count and summed RSS, threads and fds; the trainer's own
        numbers; the tree's shared-memory objects; /dev/shm entries created since the probe started."""
        try:
            root_cmdline = _read(f"/proc/{root}/cmdline").replace("\0", " ")
        except OSError:
            return {}
        procs = []
        for pid in tree(root):
            p = read_proc(pid, role(pid, root, root_cmdline, self.rollout_process))
            start = _start_time(pid)
            if p is None or start is None:
                continue
            procs.append(p)
            self.seen.setdefault((pid, start), p.role)
        row: dict[str, float] = {"time": time.time(), "processes": len(procs),
                                 "children": len(procs) - 1, "rss_mb_total": sum(p.rss_mb for p in procs),
                                 "threads_total": sum(p.threads for p in procs), "fds_total": sum(p.fds for p in procs),
                                 "shm_tree": len(set().union(*(p.shm for p in procs))) if procs else 0,
                                 "dev_shm_new": len(set(os.listdir("/dev/shm")) - self.shm_at_start)}
        for r in ROLES:
            mine = [p for p in procs if p.role == r]
            row[f"{r}_n"] = len(mine)
            row[f"{r}_rss_mb"] = sum(p.rss_mb for p in mine)
            row[f"{r}_threads"] = sum(p.threads for p in mine)
            row[f"{r}_fds"] = sum(p.fds for p in mine)
        return row

    def survivors(self) -> list[str]:
        """Every process of any sampled tree that is still alive (not a zombie), as 'pid role cmdline'."""
        left = []
        for (pid, start), r in self.seen.items():
            if _start_time(pid) == start:
                try:
                    cmd = _read(f"/proc/{pid}/cmdline").replace("\0", " ")[:160]
                except OSError:
                    continue
                left.append(f"{pid} {r} {cmd}")
        return left

    def dev_shm_left(self) -> list[str]:
        """/dev/shm entries created since the probe started that no process holds: left behind. (Entries a
        live process maps or has open are other work's on a shared machine; ours would be an orphan's.)"""
        return unheld(set(os.listdir("/dev/shm")) - self.shm_at_start)


def unheld(names: set[str]) -> list[str]:
    """Those of the /dev/shm entry `names` that still exist and that no process on the machine holds."""
    held: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        held |= {h[len("/dev/shm/"):] for h in _shm_objects(int(pid)) if h.startswith("/dev/shm/")}
    return sorted(n for n in names if n not in held and os.path.exists(os.path.join("/dev/shm", n)))
