"""The operating-system side of the engine launcher (launcher.py): probing a server's /health, reading the
tail of its log, and the process-group plumbing that makes sure no engine outlives the process that
started it — each server in its own process group (signalled group-wide, with `group_alive` telling
when the group is gone), a parent-death signal set in the child before exec, and one process-wide
cleanup (atexit, SIGTERM, SIGHUP) that stops every launcher still running.

Nothing here knows how a server is started; the cleanup only needs each launcher's `stop()`.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import urllib.error
import urllib.request
import weakref
from typing import Any, Dict, Optional, Protocol


def log_tail(path: str, *, num_lines: int = 40, max_bytes: int = 16384) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            data = f.read().decode("utf-8", errors="replace")
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return "\n".join(data.splitlines()[-num_lines:])


def probe_health(url: str, *, api_key: Optional[str] = None, timeout_s: float = 2.0) -> bool:
    """True when GET <url>/health answers 200 (synchronous: start-up runs before any event loop)."""
    request = urllib.request.Request(url + "/health")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def die_with_parent() -> None:
    """In the child before exec: ask Linux for SIGTERM when the spawning thread's process dies
    (prctl PR_SET_PDEATHSIG). A no-op where prctl does not exist. Must be called from the thread
    that lives as long as the engines (the launcher is started from the main thread)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """Any non-zombie member left in the group (zombies of reparented children do not count)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != b"Z":
                return True
        return False
    except OSError:  # no /proc (macOS): trust killpg
        return True


class _Stoppable(Protocol):
    def stop(self) -> None: ...


# -- process-wide cleanup: atexit and SIGTERM/SIGHUP stop every live launcher ------------------
_LIVE: "weakref.WeakSet[_Stoppable]" = weakref.WeakSet()
_HANDLERS_INSTALLED = False
_PREVIOUS: Dict[int, Any] = {}


def stop_all() -> None:
    for launcher in list(_LIVE):
        launcher.stop()


def _on_signal(signum: int, frame: Any) -> None:
    stop_all()
    previous = _PREVIOUS.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def stop_at_exit(launcher: _Stoppable) -> None:
    """Stop `launcher` at interpreter exit and on SIGTERM/SIGHUP (handlers installed once, from the
    main thread, chaining to the previous handler)."""
    global _HANDLERS_INSTALLED
    _LIVE.add(launcher)
    if _HANDLERS_INSTALLED:
        return
    _HANDLERS_INSTALLED = True
    atexit.register(stop_all)
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            _PREVIOUS[signum] = signal.getsignal(signum)
            signal.signal(signum, _on_signal)
