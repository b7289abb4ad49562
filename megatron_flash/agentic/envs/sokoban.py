"""Sokoban: push every box onto a target.

Room. A ``size`` x ``size`` interior (outside it is wall) generated from the seed by reverse play:
random inner walls (each cell with probability ``wall_prob``, floor kept connected), boxes placed
on ``num_boxes`` random targets, the player on a random free cell next to a box; then the player walks
``num_reverse_steps`` random moves backwards, pulling a box it walks away from (with probability
3/4). Each reverse move undoes a legal forward move, so every state on the walk is solvable by
replaying the walk forwards; the level is the state whose boxes lie farthest (summed Manhattan
distance) from where they started, the latest such one on ties. Every level is therefore solvable
in at most ``num_reverse_steps`` moves (keep ``max_steps`` at least that); walks that never move a
box off its target are redrawn. Same seed, same parameters -> same level.

Observation. ``map:`` then the interior rows top to bottom joined by ``|``::

    w wall   e empty floor   t empty target   b box   x box on a target
    p player   s player standing on a target

The first observation starts with the instructions (unless ``show_instructions=false``)::

    sokoban: push each b onto a t, p is you, s is you on a t, x is a box on a t, w is wall,
    move with l r u d map:eeeee|eteee|eebpe|eweee|eeeee     (one line)

Action. ``l r u d`` (or ``left right up down``); the first direction word in the reply counts
(see ``base.parse_direction``). Walking into a wall, the edge, or a box that cannot move (wall,
edge or another box behind it) leaves the state unchanged; that is a valid move.

Reward and end. The step that puts the last box on a target: exactly 1.0, done,
``info["success"]``. Any other step: ``step_penalty`` plus ``box_reward`` times the change in boxes
on targets (+``box_reward`` for a push onto a target, -``box_reward`` off one; default 0).
``info["boxes_on_target"]`` counts them after the step. Unparseable reply: ``invalid_penalty``,
state unchanged, observation ``invalid map:...``, done only with ``end_on_invalid``. After
``max_steps`` steps the episode ends with ``info["truncated"]``.
"""

from __future__ import annotations

import collections
import random
from typing import Optional

from megatron_flash.agentic.envs.base import (DIRECTIONS, TextEnv, _check_float, _check_int,
                                              parse_direction, random_direction)
from megatron_flash.agentic.protocol import EnvError
from megatron_flash.agentic.registry import register_env

Cell = tuple[int, int]

PULL_PROB = 0.75
_MAX_ATTEMPTS = 1000


def _add(cell: Cell, delta: tuple[int, int]) -> Cell:
    return cell[0] + delta[0], cell[1] + delta[1]


def _connected(floor: set[Cell]) -> bool:
    start = min(floor)
    seen = {start}
    queue = collections.deque([start])
    while queue:
        cell = queue.popleft()
        for delta in DIRECTIONS.values():
            nxt = _add(cell, delta)
            if nxt in floor and nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return len(seen) == len(floor)


def generate_level(rng: random.Random, *, size: int, num_boxes: int, wall_prob: float,
                   num_reverse_steps: int) -> tuple[set[Cell], set[Cell], set[Cell], Cell]:
    """(floor, targets, boxes, player) of an unsolved level solvable in <= num_reverse_steps moves."""
    cells = [(r, c) for r in range(size) for c in range(size)]
    for _ in range(_MAX_ATTEMPTS):
        floor = {cell for cell in cells if rng.random() >= wall_prob}
        if len(floor) < 2 * num_boxes + 2 or not _connected(floor):
            continue
        ordered = sorted(floor)
        targets = rng.sample(ordered, num_boxes)
        boxes = list(targets)  # box i started on targets[i]
        # The solved state right after the last push: the player stands next to a box.
        free = [cell for cell in ordered if cell not in boxes]
        beside = [cell for cell in free
                  if any(_add(cell, delta) in boxes for delta in DIRECTIONS.values())]
        player = rng.choice(beside or free)
        best, best_score = None, 0
        moves = 0
        for _ in range(8 * num_reverse_steps):
            if moves == num_reverse_steps:
                break
            delta = DIRECTIONS[rng.choice("lrud")]
            nxt = _add(player, delta)
            if nxt not in floor or nxt in boxes:
                continue
            behind = (player[0] - delta[0], player[1] - delta[1])
            if behind in boxes and rng.random() < PULL_PROB:
                boxes[boxes.index(behind)] = player  # undoes the forward push of that box
            player = nxt
            moves += 1
            # Every state on the walk is solvable; keep the one with the boxes farthest out.
            score = sum(abs(b[0] - t[0]) + abs(b[1] - t[1]) for b, t in zip(boxes, targets))
            if score >= best_score and set(boxes) != set(targets):
                best, best_score = (set(boxes), player), score
        if best is not None:
            return floor, set(targets), best[0], best[1]
    raise EnvError(f"sokoban: no level of size {size} with {num_boxes} boxes, wall_prob={wall_prob} "
                   f"in {_MAX_ATTEMPTS} attempts")


@register_env("sokoban")
class SokobanEnv(TextEnv):
    env_name = "sokoban"
    instructions = ("sokoban: push each b onto a t, p is you, s is you on a t, x is a box on a t, "
                    "w is wall, move with l r u d")

    def __init__(self, *, size: int = 5, num_boxes: int = 1, wall_prob: float = 0.1,
                 num_reverse_steps: int = 10, box_reward: float = 0.0, step_penalty: float = 0.0,
                 max_steps: int = 20, invalid_penalty: float = 0.0, end_on_invalid: bool = False,
                 show_instructions: bool = True) -> None:
        """
        size: side of the square interior (3..10).
        num_boxes: boxes (= targets), 1..size.
        wall_prob: chance that an interior cell is wall (0..0.5).
        num_reverse_steps: length of the generating reverse walk = bound on the solution length.
        box_reward: shaping per box pushed onto (+) / off (-) a target.
        step_penalty: added to the reward of every step that does not solve the level.
        max_steps: steps per episode.
        invalid_penalty, end_on_invalid: reward of / episode end on an unparseable reply.
        show_instructions: start the first observation with the instructions.
        """
        _check_int("size", size, minimum=3, maximum=10)
        _check_int("num_boxes", num_boxes, minimum=1, maximum=size)
        _check_float("wall_prob", wall_prob, minimum=0.0, maximum=0.5)
        _check_int("num_reverse_steps", num_reverse_steps, minimum=1)
        _check_float("box_reward", box_reward)
        _check_float("step_penalty", step_penalty)
        super().__init__(max_steps=max_steps, invalid_penalty=invalid_penalty,
                         end_on_invalid=end_on_invalid, show_instructions=show_instructions)
        self.size = size
        self.num_boxes = num_boxes
        self.wall_prob = float(wall_prob)
        self.num_reverse_steps = num_reverse_steps
        self.box_reward = float(box_reward)
        self.step_penalty = float(step_penalty)
        self.floor: set[Cell] = set()
        self.targets: set[Cell] = set()
        self.boxes: set[Cell] = set()
        self.player: Cell = (0, 0)

    def __repr__(self) -> str:
        return f"SokobanEnv(size={self.size}, num_boxes={self.num_boxes}, seed={self.seed})"

    def _new_episode(self, seed: int) -> None:
        self.floor, self.targets, self.boxes, self.player = generate_level(
            random.Random(seed), size=self.size, num_boxes=self.num_boxes,
            wall_prob=self.wall_prob, num_reverse_steps=self.num_reverse_steps)

    def parse_action(self, action_text: str) -> Optional[str]:
        return parse_direction(action_text)

    def _apply(self, action: str) -> tuple[float, bool, bool, dict]:
        before = len(self.boxes & self.targets)
        delta = DIRECTIONS[action]
        nxt = _add(self.player, delta)
        if nxt in self.floor:
            if nxt not in self.boxes:
                self.player = nxt
            else:
                beyond = _add(nxt, delta)
                if beyond in self.floor and beyond not in self.boxes:
                    self.boxes.remove(nxt)
                    self.boxes.add(beyond)
                    self.player = nxt
        after = len(self.boxes & self.targets)
        info = {"boxes_on_target": after}
        if after == self.num_boxes:
            return 1.0, True, True, info
        return self.step_penalty + self.box_reward * (after - before), False, False, info

    def render(self) -> str:
        rows = []
        for r in range(self.size):
            row = []
            for c in range(self.size):
                cell = (r, c)
                if cell not in self.floor:
                    row.append("w")
                elif cell == self.player:
                    row.append("s" if cell in self.targets else "p")
                elif cell in self.boxes:
                    row.append("x" if cell in self.targets else "b")
                else:
                    row.append("t" if cell in self.targets else "e")
            rows.append("".join(row))
        return "map:" + "|".join(rows)

    @staticmethod
    def random_valid_action(rng: random.Random) -> str:
        return random_direction(rng)
