"""The run's timeline (`logging.trace: true`): every stage as a span in Chrome's trace-event format,
which Perfetto (ui.perfetto.dev) and chrome://tracing open; and the engines' request intervals,
kept always (cheaply, in memory) for the `pipeline/overlap` metric.

    with TRACER.span("optimizer step", "train", TRAINER, mini_batch=i):     nested spans of one
        ...                                                                  thread share one row
    with TRACER.concurrent("reward", "reward", "rewards", prompt=7) as info:  spans that overlap on
        info["reward"] = ...                                                 a track: each gets the
    handle = TRACER.begin("request", "engine", "engine 0", rid=rid)           lowest free row
    TRACER.end(handle, finish="stop")
    TRACER.instant("drop", "buffer", "buffer", reason="stale")

Tracks: a track is one process in the viewer ("trainer", "buffer", "rewards", "envs", "engine 0",
...), its rows ("lanes") its threads. The trainer track holds rank 0's main thread: batch wait,
π_prox/reference forwards, optimizer steps, the weight push (pause / buckets / resume / probe),
evaluation and checkpoints. An engine track holds its requests from dispatch to reply, one per
lane; name and args say how each ended (stop, length, abort, error), its prompt, the versions
it spans, its resume count and retractions.

Clock: `time.monotonic_ns()` (CLOCK_MONOTONIC, one clock for every process of the machine);
events keep raw nanoseconds and the writer subtracts the run's origin. The rollout process
(`rollout.runner=process`) buffers its events (`forward()`), and the controller pulls them with
each step's metrics (`RolloutRuntime.take_activity`) and `add`s them here: same clock, same file.
Engine servers are other processes too, but their requests are recorded where the proxy sends and
receives them, so nothing is needed from them.

Files: events are written at the end of every step (`step_done`), so memory holds one step's
events. Steps [0, N) go to {run_dir}/trace.json, [k·N, (k+1)·N) to trace.{k}.json with N =
`logging.trace_rotate_steps`: each file stays bounded and opens alone. Each file is valid JSON
after every step (the closing brackets are rewritten behind the last event), so a crashed run's
trace opens too. A resumed run that reaches an existing file writes beside it: trace-1.json,
trace.{k}-1.json (then -2, ...).

Off (the default): every method returns at a single attribute check and nothing is written.
Thread-safe (the rollout loop, reward threads and the trainer record concurrently).
"""

from __future__ import annotations

import collections
import contextvars
import heapq
import json
import os
import threading
import time
from typing import Any, Iterable, Optional, Sequence

TRAINER = "trainer"
"""The track of trainer rank 0's main thread."""
TRACK_ORDER = ("trainer", "buffer", "rewards", "envs", "episodes", "rollout", "engine")
"""Tracks are listed in this order (by name prefix); engines by number."""

_now = time.monotonic_ns
_ENCODE = json.JSONEncoder(default=str, separators=(",", ":")).encode  # one encoder: not one per event
Event = tuple  # (ph, name, cat, track, lane, t_ns, dur_ns, args)

REQUEST_TAGS: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("megatron_flash_request_tags",
                                                                              default=None)
"""What the caller knows about the requests it sends from the current asyncio task (prompt index,
start version, resume count): the proxy adds it to each request's span. Set it with `tag_requests`."""


def tag_requests(**tags: Any) -> None:
    """Tag the engine requests the current asyncio task sends next (no-op while tracing is off)."""
    if TRACER.enabled:
        REQUEST_TAGS.set(tags)


class _Span:
    __slots__ = ("tracer", "name", "cat", "track", "args", "t0")

    def __init__(self, tracer: "Tracer", name: str, cat: str, track: str, args: dict) -> None:
        self.tracer, self.name, self.cat, self.track, self.args = tracer, name, cat, track, args

    def __enter__(self) -> dict:
        self.t0 = _now()
        return self.args  # the block may add args (results) before it ends

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.args["error"] = f"{exc_type.__name__}: {exc}"[:200]
        self.tracer._record(("X", self.name, self.cat, self.track, 0, self.t0, _now() - self.t0, self.args))


class _LaneSpan:
    __slots__ = ("tracer", "name", "cat", "track", "args", "handle")

    def __init__(self, tracer: "Tracer", name: str, cat: str, track: str, args: dict) -> None:
        self.tracer, self.name, self.cat, self.track, self.args = tracer, name, cat, track, args

    def __enter__(self) -> dict:
        self.handle = self.tracer.begin(self.name, self.cat, self.track, **self.args)
        return self.handle.args if self.handle is not None else {}

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and self.handle is not None:
            self.handle.args["error"] = f"{exc_type.__name__}: {exc}"[:200]
        self.tracer.end(self.handle)


class _Null:
    __slots__ = ()

    def __enter__(self) -> dict:
        return {}

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL = _Null()


class Handle:
    """An open concurrent span (`Tracer.begin`); `Tracer.end` closes it."""

    __slots__ = ("name", "cat", "track", "lane", "t0", "args", "generation")

    def __init__(self, name: str, cat: str, track: str, lane: int, t0: int, args: dict, generation: int) -> None:
        self.name, self.cat, self.track, self.lane, self.t0, self.args = name, cat, track, lane, t0, args
        self.generation = generation


class Tracer:
    """The process-wide timeline recorder (`TRACER`); see the module docstring."""

    def __init__(self) -> None:
        self.enabled = False
        self.forwarding = False  # in the rollout process: events wait for the controller to pull them
        self._lock = threading.Lock()
        self._events: list[Event] = []
        self._free: dict[str, list[int]] = {}  # track → free lanes (a heap)
        self._next_lane: dict[str, int] = {}
        self._file: Optional[TraceFile] = None
        self._generation = 0  # lanes of spans begun before a restart are not handed out again

    # ------------------------------------------------------------------ lifecycle
    def start(self, run_dir: str, *, rotate_steps: int) -> None:
        """Record, and write to {run_dir}/trace*.json at each `step_done`."""
        file = TraceFile(run_dir, rotate_steps=rotate_steps, origin_ns=_now())
        with self._lock:
            self._reset()
            self._file = file
            self.enabled = True

    def forward(self) -> None:
        """Record for another process's tracer (the rollout process): `drain` hands the events over."""
        with self._lock:
            self._reset()
            self.forwarding = self.enabled = True

    def stop(self) -> None:
        """Write what is left and close the file; recording stops."""
        with self._lock:
            self.enabled = False
            if self._file is not None:
                self._file.write(self._events, step=None)
                self._file.close()
            self._reset()

    def _reset(self) -> None:
        self._generation += 1
        self.enabled = self.forwarding = False
        self._events, self._free, self._next_lane, self._file = [], {}, {}, None

    @property
    def path(self) -> Optional[str]:
        """The file being written (None when not writing)."""
        return None if self._file is None else self._file.path

    # ------------------------------------------------------------------ recording
    def span(self, name: str, cat: str, track: str, /, **args: Any) -> Any:
        """A `with` block as one span on lane 0 of `track` (nested blocks of one thread nest)."""
        if not self.enabled:
            return _NULL
        return _Span(self, name, cat, track, args)

    def concurrent(self, name: str, cat: str, track: str, /, **args: Any) -> Any:
        """A `with` block as one span on its own lane of `track` (`begin`/`end`): for spans that
        overlap others there (asyncio tasks, worker threads). The block may add args to the dict
        it gets."""
        if not self.enabled:
            return _NULL
        return _LaneSpan(self, name, cat, track, args)

    def begin(self, name: str, cat: str, track: str, /, **args: Any) -> Optional[Handle]:
        """Open a span that may overlap others on `track`: it gets the lowest free lane."""
        if not self.enabled:
            return None
        with self._lock:
            free = self._free.setdefault(track, [])
            if free:
                lane = heapq.heappop(free)
            else:
                lane = self._next_lane.get(track, 0)
                self._next_lane[track] = lane + 1
            generation = self._generation
        return Handle(name, cat, track, lane, _now(), args, generation)

    def end(self, handle: Optional[Handle], /, *, name: Optional[str] = None, **args: Any) -> None:
        """Close `handle` (None: tracing was off when it began), adding `args`; `name` renames it."""
        if handle is None:
            return
        handle.args.update(args)
        event = ("X", name or handle.name, handle.cat, handle.track, handle.lane, handle.t0, _now() - handle.t0,
                 handle.args)
        with self._lock:
            if handle.generation == self._generation:
                heapq.heappush(self._free.setdefault(handle.track, []), handle.lane)
                if self.enabled:
                    self._events.append(event)

    def complete(self, name: str, cat: str, track: str, /, *, start_ns: int, end_ns: int, **args: Any) -> None:
        """A span whose times were taken elsewhere (lane 0)."""
        if self.enabled:
            self._record(("X", name, cat, track, 0, start_ns, max(0, end_ns - start_ns), args))

    def instant(self, name: str, cat: str, track: str, /, **args: Any) -> None:
        if self.enabled:
            self._record(("i", name, cat, track, 0, _now(), 0, args))

    def _record(self, event: Event) -> None:
        with self._lock:
            if self.enabled:
                self._events.append(event)

    # ------------------------------------------------------------------ hand-over and files
    def drain(self) -> list[Event]:
        """The events recorded since the last call (the rollout process hands them to the controller)."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def add(self, events: Iterable[Event]) -> None:
        """Events recorded by another process of this machine (same clock)."""
        with self._lock:
            if self.enabled:
                self._events.extend(events)

    def step_done(self, step: int) -> None:
        """Write this step's events; after every `rotate_steps` steps the next file begins."""
        if not self.enabled or self.forwarding or self._file is None:
            return
        with self._lock:
            events, self._events = self._events, []
            self._file.write(events, step=step)


class TraceFile:
    """The writer: one file per `rotate_steps` steps, each a trace-event JSON object, valid after every
    write (the closing brackets are rewritten behind the last event)."""

    TAIL = "\n]}\n"

    def __init__(self, run_dir: str, *, rotate_steps: int, origin_ns: int) -> None:
        if rotate_steps < 1:
            raise ValueError(f"logging.trace_rotate_steps must be >= 1, got {rotate_steps}")
        self.run_dir, self.rotate_steps, self.origin_ns = run_dir, rotate_steps, origin_ns
        self._pids: dict[str, int] = {}
        self._f: Any = None
        self.path = ""
        self.index = -1

    def _open(self, index: int) -> None:
        self.close()
        os.makedirs(self.run_dir, exist_ok=True)
        base = "trace" if index == 0 else f"trace.{index}"
        path, n = os.path.join(self.run_dir, base + ".json"), 0
        while os.path.exists(path):  # a resumed run never overwrites an earlier process's trace
            n += 1
            path = os.path.join(self.run_dir, f"{base}-{n}.json")
        self.path, self.index = path, index
        self._f = open(path, "w", encoding="utf-8")
        head = json.dumps({"displayTimeUnit": "ms", "otherData": {
            "clock": "CLOCK_MONOTONIC", "origin_ns": self.origin_ns,
            "steps": [index * self.rotate_steps, (index + 1) * self.rotate_steps - 1]}})
        self._f.write(head[:-1] + ', "traceEvents": [\n')
        self._body_end = self._f.tell()
        self._empty = True
        self._named: set[tuple[str, int]] = set()  # (track, lane) described in this file
        self._f.write(self.TAIL)
        self._f.flush()

    def _pid(self, track: str) -> int:
        pid = self._pids.get(track)
        if pid is None:
            pid = self._pids[track] = len(self._pids) + 1
        return pid

    def _metadata(self, track: str, lane: int) -> list[dict]:
        """Each file names the tracks and lanes it uses (it must open alone)."""
        pid, out = self._pid(track), []
        if (track, -1) not in self._named:
            self._named.add((track, -1))
            out += [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": track}},
                    {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                     "args": {"sort_index": sort_index(track)}}]
        if (track, lane) not in self._named:
            self._named.add((track, lane))
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": lane + 1,
                        "args": {"name": track if lane == 0 else f"{track} #{lane}"}})
        return out

    def to_json(self, event: Event) -> list[dict]:
        ph, name, cat, track, lane, t_ns, dur_ns, args = event
        out = self._metadata(track, lane)
        e = {"ph": ph, "name": name, "cat": cat, "pid": self._pid(track), "tid": lane + 1,
             "ts": round((t_ns - self.origin_ns) / 1e3, 3), "args": args}
        if ph == "X":
            e["dur"] = round(dur_ns / 1e3, 3)
        else:
            e["s"] = "t"
        out.append(e)
        return out

    def write(self, events: Sequence[Event], *, step: Optional[int]) -> None:
        """Append `events`, recorded up to the end of `step` (None: the run's last events), to the file
        of that step; after the last step of a file the next step's file begins."""
        index = self.index if step is None else step // self.rotate_steps
        if index < 0 and not events:
            return
        if self._f is None or index != self.index:
            self._open(max(index, 0))
        if events:
            lines = [_ENCODE(e) for ev in events for e in self.to_json(ev)]
            self._f.seek(self._body_end)
            self._f.write(("" if self._empty else ",\n") + ",\n".join(lines))
            self._empty = False
            self._body_end = self._f.tell()
            self._f.write(self.TAIL)
            self._f.truncate()
            self._f.flush()
        if step is not None and (step + 1) % self.rotate_steps == 0:
            self.close()  # the next step starts trace.{k+1}.json
            self.index += 1

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def sort_index(track: str) -> int:
    for i, prefix in enumerate(TRACK_ORDER):
        if track.startswith(prefix):
            number = track[len(prefix):].strip()
            return 100 * i + (int(number) if number.isdigit() else 0)
    return 100 * len(TRACK_ORDER)


TRACER = Tracer()


# ---------------------------------------------------------------------------------- activity
class RequestActivity:
    """When engine requests were in flight (dispatch → reply), always recorded: one clock read and a
    few dict operations per request. Finished intervals are kept until `take` (once per step), at
    most `max_intervals` of them (the oldest go first, e.g. where nobody takes them)."""

    def __init__(self, max_intervals: int = 200_000) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, int] = {}
        self._done: collections.deque = collections.deque(maxlen=max_intervals)
        self._next = 0

    def begin(self) -> int:
        with self._lock:
            token = self._next
            self._next += 1
            self._open[token] = _now()
        return token

    def end(self, token: int) -> None:
        t = _now()
        with self._lock:
            start = self._open.pop(token, None)
            if start is not None:
                self._done.append((start, t))

    def take(self) -> tuple[list[tuple[int, int]], list[int], int]:
        """(intervals finished since the last take, starts of those still open, now), in ns."""
        with self._lock:
            done, self._done = list(self._done), collections.deque(maxlen=self._done.maxlen)
            return done, list(self._open.values()), _now()


ACTIVITY = RequestActivity()


def busy_fraction(intervals: Sequence[tuple[int, int]], open_starts: Sequence[int], *, lo: int, hi: int,
                  now: int) -> float:
    """The fraction of [lo, hi] covered by the union of `intervals` and of [start, now] for each open
    start: how much of that window at least one request was in flight."""
    if hi <= lo:
        return 0.0
    spans = [*intervals, *((s, now) for s in open_starts)]
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in spans)
    covered, reach = 0, lo
    for a, b in clipped:
        if b <= a or b <= reach:
            continue
        covered += b - max(a, reach)
        reach = b
    return covered / (hi - lo)
