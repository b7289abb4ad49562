"""One simulated engine: processor sharing on a virtual clock, and which weights decoded each token.

All sequences of an engine advance one token per decode step, whose cost depends on how many there
are. The engine's virtual clock S counts tokens served to every running sequence, so a sequence that
starts decoding at S0 with L tokens ends when S reaches S0 + L, and its i-th token is decoded as S
passes S0 + i.

Token versions. At each weight push the simulation marks S (`mark_push`): a token decoded at a
virtual position x was sampled by version #{pushes marked below x}. This is what the engines label
in every pause mode: abort and retract re-generate under the new weights (the prefix re-prefilled,
its tokens keep their labels), in_place continues on the old KV but samples with the new weights. The
pause itself and the re-prefill cost no time here. Worked example: a sequence decodes positions
(10, 20] and pushes were marked at S = 4 (version 1) and S = 16 (version 2): tokens 11..16 are of
version 1 and 17..20 of version 2, so the version sum is 10·1 + 4·1 = 14 (`version_sum(10, 20)`).
"""

from __future__ import annotations

import bisect
import math
from typing import Callable


class Engine:
    """Processor sharing with a per-engine virtual clock S (tokens served to every active sequence)."""

    def __init__(self, decode_step: Callable[[int], float]):
        self.step = decode_step
        self.S = 0.0
        self.t = 0.0
        self.ends: list[tuple[float, int, float]] = []  # (S at which a member ends, request id, S it started at)
        self.slots = 0  # sequences decoding (a request of n sampled sequences: its members not yet ended)
        self.held = 0  # admission slots held (the proxy: a request of n holds n until its last member ends)
        self.busy_s = 0.0
        self.stall = 0.0  # engine-exclusive seconds still owed (request_engine_s): nothing decodes meanwhile
        self.pushes: list[float] = []  # S at each weight push, in order (version k began at pushes[k - 1])

    def advance(self, t: float) -> None:
        dt = t - self.t
        if self.stall:
            used = min(self.stall, dt)
            self.stall -= used
            self.busy_s += used
            dt -= used
        if self.slots and dt > 0:
            self.S += dt / self.step(self.slots)
            self.busy_s += dt
        self.t = t

    def next_end(self) -> float:
        if not self.ends:
            return math.inf
        return self.t + self.stall + max(0.0, self.ends[0][0] - self.S) * self.step(self.slots)

    def mark_push(self, t: float) -> None:
        """A weight push at time `t`: tokens decoded after it are of the next version."""
        self.advance(t)
        self.pushes.append(self.S)

    def version_sum(self, start: float, end: float) -> float:
        """Sum over the tokens decoded at virtual positions (start, end] of the version that sampled each
        (continuous: a push inside a decode step splits that token)."""
        total = (end - start) * bisect.bisect_right(self.pushes, start)  # pushes before it began: every token
        for s in self.pushes[bisect.bisect_right(self.pushes, start):bisect.bisect_left(self.pushes, end)]:
            total += end - s
        return total
