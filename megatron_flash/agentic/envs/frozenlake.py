"""FrozenLake: walk across a frozen lake to the goal without falling into a hole.

Map. ``size`` x ``size`` cells, generated from the seed: every cell is a hole with probability
``hole_prob``, start and goal are two distinct random non-hole cells, and a map is kept only if a
breadth-first search finds a path from start to goal of at most ``max_steps`` moves (otherwise the
seed's generator draws again). Same seed, same parameters -> same map.

Observation. ``map:`` then the rows top to bottom joined by ``|``; ``f`` frozen, ``h`` hole,
``g`` goal, ``p`` the player (drawn over whatever cell it stands on). Outside the map is a wall.
The first observation starts with the instructions (unless ``show_instructions=false``)::

    frozenlake: reach g, avoid h, move with l r u d map:ffhf|pfff|fhfh|fffg

Action. One of ``l r u d`` (or ``left right up down``); the first direction word in the reply
counts (see ``base.parse_direction``). A move into the edge leaves the player in place. With
``slippery=true`` the player moves in the intended direction with probability 1/3 and in each of
the two perpendicular ones with 1/3 (as Gymnasium's FrozenLake), drawn from a per-episode stream
seeded by the episode seed, so transitions are reproducible too.

Reward and end. Reaching ``g``: reward 1.0, done, ``info["success"]``. Falling into ``h``: 0.0,
done. Any other move: ``step_penalty`` (default 0; use a negative value to penalize). An
unparseable reply: ``invalid_penalty``, state unchanged, observation ``invalid map:...``, done
only with ``end_on_invalid``. After ``max_steps`` steps (valid or not) the episode ends with
``info["truncated"]``. ``info["moved"]`` is the direction actually taken (differs when slipping).
"""

from __future__ import annotations

import collections
import random
from typing import Optional

from megatron_flash.agentic.envs.base import (DIRECTIONS, TextEnv, _check_bool, _check_float,
                                              _check_int, parse_direction, random_direction)
from megatron_flash.agentic.protocol import EnvError
from megatron_flash.agentic.registry import register_env

Cell = tuple[int, int]

_PERPENDICULAR = {"l": "ud", "r": "ud", "u": "lr", "d": "lr"}
_MAX_ATTEMPTS = 10_000


def shortest_path_length(rows: list[str], start: Cell, goal: Cell) -> Optional[int]:
    """Moves on the fewest-move path from start to goal over non-hole cells, or None."""
    size = len(rows)
    dist = {start: 0}
    queue = collections.deque([start])
    while queue:
        cell = queue.popleft()
        if cell == goal:
            return dist[cell]
        for dr, dc in DIRECTIONS.values():
            nxt = (cell[0] + dr, cell[1] + dc)
            if (0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in dist
                    and rows[nxt[0]][nxt[1]] != "h"):
                dist[nxt] = dist[cell] + 1
                queue.append(nxt)
    return None


def generate_map(rng: random.Random, *, size: int, hole_prob: float,
                 max_moves: int) -> tuple[list[str], Cell]:
    """(rows with f/h/g, start cell) such that the goal is reachable in at most max_moves moves."""
    cells = [(r, c) for r in range(size) for c in range(size)]
    for _ in range(_MAX_ATTEMPTS):
        holes = {cell for cell in cells if rng.random() < hole_prob}
        free = [cell for cell in cells if cell not in holes]
        if len(free) < 2:
            continue
        start, goal = rng.sample(free, 2)
        rows = ["".join("g" if (r, c) == goal else "h" if (r, c) in holes else "f"
                        for c in range(size)) for r in range(size)]
        length = shortest_path_length(rows, start, goal)
        if length is not None and length <= max_moves:
            return rows, start
    raise EnvError(f"frozenlake: no solvable {size}x{size} map with hole_prob={hole_prob} and "
                   f"max_steps={max_moves} in {_MAX_ATTEMPTS} attempts")


@register_env("frozenlake")
class FrozenLakeEnv(TextEnv):
    env_name = "frozenlake"
    instructions = "frozenlake: reach g, avoid h, move with l r u d"

    def __init__(self, *, size: int = 4, hole_prob: float = 0.2, slippery: bool = False,
                 step_penalty: float = 0.0, max_steps: Optional[int] = None,
                 invalid_penalty: float = 0.0, end_on_invalid: bool = False,
                 show_instructions: bool = True) -> None:
        """
        size: side of the square map (2..16).
        hole_prob: chance that a cell is a hole (0..0.8).
        slippery: moves go sideways with probability 2/3 (seeded).
        step_penalty: reward of a move that neither reaches the goal nor falls in a hole.
        max_steps: steps per episode; default size*size, which any shortest path fits in.
        invalid_penalty, end_on_invalid: reward of / episode end on an unparseable reply.
        show_instructions: start the first observation with the instructions.
        """
        _check_int("size", size, minimum=2, maximum=16)
        _check_float("hole_prob", hole_prob, minimum=0.0, maximum=0.8)
        _check_bool("slippery", slippery)
        _check_float("step_penalty", step_penalty)
        if max_steps is None:
            max_steps = size * size
        super().__init__(max_steps=max_steps, invalid_penalty=invalid_penalty,
                         end_on_invalid=end_on_invalid, show_instructions=show_instructions)
        self.size = size
        self.hole_prob = float(hole_prob)
        self.slippery = slippery
        self.step_penalty = float(step_penalty)
        self.rows: list[str] = []
        self.start: Cell = (0, 0)
        self.player: Cell = (0, 0)
        self._slip_rng = random.Random()

    def __repr__(self) -> str:
        return f"FrozenLakeEnv(size={self.size}, seed={self.seed})"

    def _new_episode(self, seed: int) -> None:
        self.rows, self.start = generate_map(random.Random(seed), size=self.size,
                                             hole_prob=self.hole_prob, max_moves=self.max_steps)
        self.player = self.start
        self._slip_rng = random.Random(f"frozenlake-slip-{seed}")

    def parse_action(self, action_text: str) -> Optional[str]:
        return parse_direction(action_text)

    def _apply(self, action: str) -> tuple[float, bool, bool, dict]:
        if self.slippery:
            action = self._slip_rng.choice(action + _PERPENDICULAR[action])
        dr, dc = DIRECTIONS[action]
        r, c = self.player[0] + dr, self.player[1] + dc
        if 0 <= r < self.size and 0 <= c < self.size:
            self.player = (r, c)
        cell = self.rows[self.player[0]][self.player[1]]
        if cell == "g":
            return 1.0, True, True, {"moved": action}
        if cell == "h":
            return 0.0, True, False, {"moved": action}
        return self.step_penalty, False, False, {"moved": action}

    def render(self) -> str:
        rows = [list(row) for row in self.rows]
        rows[self.player[0]][self.player[1]] = "p"
        return "map:" + "|".join("".join(row) for row in rows)

    @staticmethod
    def random_valid_action(rng: random.Random) -> str:
        return random_direction(rng)
