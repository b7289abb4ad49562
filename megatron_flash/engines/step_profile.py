"""Where a decode step of the local engine spends its time: cumulative wall seconds per phase of
transformers' continuous-batching loop, read from /get_server_info (`step_profile`).

    one CB loop pass with work ─┬─ host: prepare_next_batch (scheduling, new requests, input tensors)
                                ├─ step: _generation_step = forward + logits processors (our sampler,
                                │        timed apart as `sampler_s`) + outputs copied to the host
                                │        (on a GPU this copy waits for the device: step ≈ device time)
                                └─ host: update_batch (token bookkeeping, finished requests out)

Why: on a GPU the decode step of this engine is flat in the batch size but far above a plain
`generate` step, so a fixed per-step cost lives somewhere in this loop; these sums say which phase
holds it (benchmarks/engine_step_cost.py prints them per step). Idle passes (no request) are not
counted. The hooks wrap two methods of transformers' manager (private API, checked at install: a
transformers without them serves as before, with `step_profile.installed` false). A pass's step,
sampler and loop times become visible together when the pass ends, so a snapshot never shows a step
without its pass (a reply leaves from inside the last step, before its pass is over).

`StepFloor` is the local engine's --decode-step-ms T (a latency-injection option for benchmarks and the
cluster tests, not for production): every decode step lasts at least T ms, whatever the number of
running sequences (1 … max_running), as a GPU's decode step costs about the same for all of them. After
the step's real work the decoder thread sleeps the remainder before it publishes the step's tokens (so
a token, and a finish, leave T after the step began, as they would from a GPU step), holding no lock:
admission, HTTP handlers and pause requests go on meanwhile (a pause is taken after the step). Prefill:
the static decoder runs one pass = a prefill of newly admitted requests (if any) then the decode of
every running one, and the floor is on the pass, so prefill + decode is one step (a GPU prefill of a
short prompt costs about one step too); the prefill's first tokens leave before the pass's floor. On
`--decoder cb` a CB step (chunked prefill and decode mixed) is one step. The slept seconds are `floor_s`
in the snapshot; `step_s` and `loop_s` include them (the step's cost as served), `sampler_s` does not.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class StepProfile:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.installed = False
        self.steps = 0
        self.graphed_steps = 0  # static decoder: steps that replayed a CUDA graph
        self.loop_s = 0.0  # whole passes that ran a step
        self.step_s = 0.0  # _generation_step
        self.sampler_s = 0.0  # our logits processor, inside the step
        self.floor_s = 0.0  # slept to reach --decode-step-ms (StepFloor); inside step_s and loop_s
        self._pending = [0, 0.0, 0.0]  # this pass's steps, step seconds, sampler seconds (not yet visible)

    def install(self, manager: Any) -> None:
        body = getattr(manager, "_generation_loop_body", None)
        step = getattr(manager, "_generation_step", None)
        if not callable(body) or not callable(step):
            return

        def timed_step(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                with self._lock:
                    self._pending[0] += 1
                    self._pending[1] += time.perf_counter() - t0

        def timed_body(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return body(*args, **kwargs)
            finally:
                with self._lock:
                    steps, step_s, sampler_s = self._pending
                    if steps:
                        self.steps += steps
                        self.step_s += step_s
                        self.sampler_s += sampler_s
                        self.loop_s += time.perf_counter() - t0
                    self._pending = [0, 0.0, 0.0]

        manager._generation_step, manager._generation_loop_body = timed_step, timed_body
        self.installed = True

    def add_pass(self, *, steps: int, step_s: float, loop_s: float, sampler_s: float, graphed: int) -> None:
        """One pass of a decoder that times itself (the static decoder: a prefill step and/or a decode step;
        `graphed` of them replayed a CUDA graph, whose sampler is inside the replay and not timed apart)."""
        with self._lock:
            self.installed = True
            self.graphed_steps += graphed
            self.steps += steps
            self.step_s += step_s
            self.sampler_s += sampler_s
            self.loop_s += loop_s

    def add_sampler(self, seconds: float) -> None:
        with self._lock:
            if self.installed:
                self._pending[2] += seconds
            else:
                self.sampler_s += seconds

    def add_floor(self, seconds: float) -> None:
        with self._lock:
            self.floor_s += seconds

    def snapshot(self) -> dict:
        with self._lock:
            return {"installed": self.installed, "steps": self.steps, "graphed_steps": self.graphed_steps, "loop_s": round(self.loop_s, 6),
                    "step_s": round(self.step_s, 6), "sampler_s": round(self.sampler_s, 6),
                    "host_s": round(self.loop_s - self.step_s, 6), "floor_s": round(self.floor_s, 6)}


def per_step(before: dict, after: dict) -> dict:
    """Mean seconds per step of each phase between two snapshots (None where no step ran)."""
    steps = after["steps"] - before["steps"]
    if steps <= 0:
        return {"steps": 0}
    out: dict = {"steps": steps}
    for key in ("loop_s", "step_s", "sampler_s", "host_s"):
        out[key] = (after[key] - before[key]) / steps
    return out


class StepFloor:
    """--decode-step-ms (module docstring). The static decoder calls `pad(pass start)` before it publishes
    a decode step's tokens; on CB, `install` marks each `_generation_step`'s start and our sampler calls
    `pad_step()` before it records the step's tokens (the step pads itself at its end if no sampling ran)."""

    def __init__(self, ms: float, profile: StepProfile) -> None:
        self.seconds, self.profile = ms / 1e3, profile
        self._step_started: float | None = None  # CB: start of the running _generation_step

    def pad(self, started: float) -> float:
        """Sleep until `started` + T (perf_counter seconds); the caller holds no lock. Returns the seconds slept."""
        remaining = started + self.seconds - time.perf_counter()
        if remaining <= 0:
            return 0.0
        time.sleep(remaining)
        self.profile.add_floor(remaining)
        return remaining

    def pad_step(self) -> float:
        """CB: `pad` from the start of the running step (nothing outside one, or with the floor off)."""
        return 0.0 if self._step_started is None else self.pad(self._step_started)

    def install(self, manager: Any) -> None:
        """Wrap transformers' CB manager's `_generation_step` (before StepProfile.install: its step_s then holds
        the floor). Scheduling before the step, and a pause window there, are not part of it."""
        if self.seconds <= 0:
            return
        step = getattr(manager, "_generation_step", None)
        if not callable(step):
            raise ValueError("--decode-step-ms: this transformers' continuous batching has no _generation_step "
                             "to floor (use --decoder static)")
        if getattr(step, "step_floor", None) is self:  # a cached manager, reused after a resume
            return

        def floored_step(*args: Any, **kwargs: Any) -> Any:
            started = self._step_started = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                self._step_started = None
                self.pad(started)  # a no-op when the sampler already waited

        floored_step.step_floor = self  # type: ignore[attr-defined]
        manager._generation_step = floored_step
