"""A small text world in the AgentBench/ALFWorld style: the built-in multi-step agentic workload.

Rooms sit on a grid; every task has its own map: which neighbouring rooms are joined by a door
(north/south/east/west; a random spanning tree plus ``extra_doors``), where the box and the bag
stand and where the objects lie are drawn per task. The room names keep their grid cells for a
seed (a compass the policy can learn: the lab is east of the hall), so the doors, never the
layout, are what each task changes. A task asks the agent to reach a goal:

* ``go``: ``Go to the lab.``
* ``take``: ``Take the coin from the lab.``
* ``put``: ``Put the coin from the lab in the box in the den.``

The agent acts with short plain-text commands, one per turn (``go north`` or ``go n``, ``take
coin``, ``put coin in box``, ``look``); a command the world cannot carry out gets an observation
saying why, never an error (a move into a wall also says where the agent still is, so it
recovers by reading). Observations list the exits with the rooms behind them (``In hall.
Exits: n lab, e den. You see key.``), so stepping toward a target in sight is reading, and the
way round a missing door is found from the exits, not memorised. They are terse on purpose: the
policies are small local models.

Generalisation: train and held-out tasks come from the same generator (i.i.d.) and are split by
a hash of the whole task (map, start, goal, objects), so no held-out task is ever trained on and
what RL improves on train is what held-out success measures. ``difficulty`` is the number of
expert steps (1..``max_difficulty``), in equal shares per split.
"""

from __future__ import annotations

import json
import random
from collections import deque
from functools import lru_cache
from typing import Any, Mapping

from pydantic import Field, model_validator

from astraflow.agents.env import Action, EnvironmentBase, Message, StepResult
from astraflow.agents.workload import AgentParams, AgentWorkload
from astraflow.workloads.base import WORKLOADS
from astraflow.workloads.split import is_held_out

ROOM_NAMES = ("hall", "den", "lab", "attic", "shed", "bath", "porch", "study", "pantry", "loft", "gym", "cellar")
OBJECTS = ("key", "coin", "apple", "book")
CONTAINERS = ("box", "bag")
#: direction -> (dx, dy); north is up (y - 1)
DIRS = {"north": (0, -1), "south": (0, 1), "east": (1, 0), "west": (-1, 0)}
_ABBREV = {d[0]: d for d in DIRS}
KINDS = ("go", "take", "put")
#: maps a task draw tries before it takes its kind and length for impossible on this grid
_ATTEMPTS = 2000


class TextWorldParams(AgentParams):
    """The text world's ``workload.params``."""

    width: int = Field(default=3, ge=2, le=4)
    """Columns of the room grid."""
    height: int = Field(default=3, ge=1, le=3)
    """Rows of the room grid (``width * height`` rooms, at most 12)."""
    extra_doors: int = Field(default=2, ge=0)
    """Doors added to each map's spanning tree (loops: more than one way round)."""
    max_difficulty: int = Field(default=4, ge=1, le=8)
    """Longest task, in expert steps."""
    test_fraction: float = Field(default=0.2, gt=0, lt=1)
    """Share of generated tasks that fall in the held-out split (by a hash of the whole task)."""
    shaped: bool = False
    """Per-turn rewards: +0.1 for progress (a step closer to the current target room, taking
    the goal object), -0.1 for a command the world cannot carry out."""
    max_turns: int = Field(default=6, ge=1)
    """Model turns per episode at most; the world ends the episode (a failure) after them."""

    @model_validator(mode="after")
    def _solvable(self) -> "TextWorldParams":
        if self.max_difficulty > self.max_turns:
            raise ValueError(f"max_difficulty {self.max_difficulty} is more than max_turns {self.max_turns}: a task "
                             "takes one turn per expert step, so the longest ones could never be solved; raise "
                             "max_turns or lower max_difficulty")
        return self


class World:
    """One task's map: the seed's room names on their grid cells, the task's doors and containers."""

    def __init__(self, width: int, height: int, extra_doors: int, seed: int, layout: int = 0):
        names = list(ROOM_NAMES)
        random.Random(f"textworld-names:{seed}").shuffle(names)
        rng = random.Random(f"textworld-map:{seed}:{layout}")
        cells = [(x, y) for y in range(height) for x in range(width)]
        self.rooms: list[str] = names[: len(cells)]
        self.cell = dict(zip(self.rooms, cells))
        at = {c: r for r, c in self.cell.items()}
        self.doors: dict[str, dict[str, str]] = {r: {} for r in self.rooms}

        def link(a: tuple[int, int], b: tuple[int, int]) -> None:
            for d, (dx, dy) in DIRS.items():
                if (a[0] + dx, a[1] + dy) == b:
                    self.doors[at[a]][d] = at[b]
                    self.doors[at[b]][_opposite(d)] = at[a]

        def neighbours(c: tuple[int, int]) -> list[tuple[int, int]]:
            return [(c[0] + dx, c[1] + dy) for dx, dy in DIRS.values() if (c[0] + dx, c[1] + dy) in at]

        first = rng.choice(cells)
        seen, stack = {first}, [first]  # randomised depth-first spanning tree
        while stack:
            free = [n for n in neighbours(stack[-1]) if n not in seen]
            if not free:
                stack.pop()
                continue
            nxt = rng.choice(free)
            link(stack[-1], nxt)
            seen.add(nxt)
            stack.append(nxt)
        missing = [(a, b) for a in cells for b in neighbours(a) if a < b and at[b] not in self.doors[at[a]].values()]
        rng.shuffle(missing)
        for a, b in missing[:extra_doors]:
            link(a, b)
        where = [rng.choice(self.rooms) for _ in CONTAINERS]
        self.container_room: dict[str, str] = dict(zip(CONTAINERS, where))
        self.dist = {r: self._bfs(r) for r in self.rooms}

    def _bfs(self, src: str) -> dict[str, int]:
        dist, queue = {src: 0}, deque([src])
        while queue:
            r = queue.popleft()
            for n in self.doors[r].values():
                if n not in dist:
                    dist[n] = dist[r] + 1
                    queue.append(n)
        return dist

    def toward(self, room: str, target: str) -> str:
        """The first direction (in ``DIRS`` order) of a shortest path from ``room`` to ``target``."""
        for d in DIRS:
            n = self.doors[room].get(d)
            if n is not None and self.dist[target][n] == self.dist[target][room] - 1:
                return d
        raise AssertionError(f"no way from {room} to {target}")


@lru_cache(maxsize=4096)
def world_of(width: int, height: int, extra_doors: int, seed: int, layout: int) -> World:
    """The (cached, read-only) map of a task."""
    return World(width, height, extra_doors, seed, layout)


def _opposite(d: str) -> str:
    return {"north": "south", "south": "north", "east": "west", "west": "east"}[d]


def expert_steps(world: World, core: Mapping[str, Any]) -> int:
    """Expert steps of a task: moves on shortest paths plus one per take/put."""
    if core["kind"] == "go":
        return world.dist[core["start"]][core["target"]]
    hops = world.dist[core["start"]][core["from"]] + 1
    if core["kind"] == "take":
        return hops
    return hops + world.dist[core["from"]][world.container_room[core["container"]]] + 1


def goal_text(world: World, core: Mapping[str, Any]) -> str:
    if core["kind"] == "go":
        return f"Go to the {core['target']}."
    if core["kind"] == "take":
        return f"Take the {core['object']} from the {core['from']}."
    box = core["container"]
    return f"Put the {core['object']} from the {core['from']} in the {box} in the {world.container_room[box]}."


class TextWorldEnv(EnvironmentBase):
    """One episode of the text world (see the module docstring); offers ``expert_action``."""

    step_timeout_s = 5.0

    def __init__(self, grid: tuple[int, int, int, int], shaped: bool = False, max_turns: int = 6):
        super().__init__()
        self.grid, self.shaped, self.max_turns = grid, shaped, max_turns  # (width, height, extra_doors, seed)

    # -- state ---------------------------------------------------------------------------

    async def reset(self, task: Mapping[str, Any]) -> list[Message]:
        self.task = dict(task)
        self.world = world_of(*self.grid, task["layout"])
        self.room = task["start"]
        self.turns = 0
        self.held: list[str] = []
        self.floor: dict[str, list[str]] = {r: [] for r in self.world.rooms}
        self.inside: dict[str, list[str]] = {c: [] for c in CONTAINERS}
        for obj, room in task["objects"]:
            self.floor[room].append(obj)
        return [{"role": "user", "content": f"{task['goal']}\n{self.describe()}"}]

    def describe(self) -> str:
        exits = ", ".join(f"{d[0]} {n}" for d, n in sorted(self.world.doors[self.room].items(), key=_dir_order))
        seen = self.floor[self.room] + [c for c, r in self.world.container_room.items() if r == self.room]
        return f"In {self.room}. Exits: {exits}." + (f" You see {', '.join(seen)}." if seen else "")

    def success(self) -> bool:
        t = self.task
        if t["kind"] == "go":
            return self.room == t["target"]
        if t["kind"] == "take":
            return t["object"] in self.held
        return t["object"] in self.inside[t["container"]]

    def steps_left(self) -> int:
        """Expert steps from here to success (moves on shortest paths, one per take and put)."""
        t, d = self.task, self.world.dist
        if t["kind"] == "go":
            return d[t["target"]][self.room]
        if t["object"] in self.held:
            return 0 if t["kind"] == "take" else d[self.target_room()][self.room] + 1
        at = self.target_room()  # where the object lies
        rest = 0 if t["kind"] == "take" else d[self.world.container_room[t["container"]]][at] + 1
        return d[at][self.room] + 1 + rest

    def target_room(self) -> str:
        """The room the expert heads for now."""
        t = self.task
        if t["kind"] == "go":
            return t["target"]
        if t["kind"] == "put" and t["object"] in self.held:
            return self.world.container_room[t["container"]]
        for c, objs in self.inside.items():
            if t["object"] in objs:
                return self.world.container_room[c]
        return next(r for r, objs in self.floor.items() if t["object"] in objs)

    def expert_action(self) -> str:
        """The next command of a scripted optimal expert from the current state."""
        t, target = self.task, self.target_room()
        if self.room != target:
            return f"go {self.world.toward(self.room, target)[0]}"  # as the exits name it
        if t["object"] not in self.held:
            return f"take {t['object']}"
        return f"put {t['object']} in {t['container']}"

    def explore_action(self, rng: random.Random) -> str:
        """A random move through one of the exits (the noisy turns of an epsilon-greedy expert)."""
        return f"go {rng.choice(sorted(self.world.doors[self.room]))[0]}"

    # -- commands ------------------------------------------------------------------------

    async def step(self, action: Action) -> StepResult:
        self.turns += 1
        before = self.steps_left()  # not done yet: a target remains
        text, valid = self.command(action.text)
        if self.success():
            return StepResult([{"role": "user", "content": text}], reward=1.0, done=True, info={"success": 1.0})
        if self.turns >= self.max_turns:
            return StepResult([{"role": "user", "content": text}], reward=0.0, done=True, info={"success": 0.0})
        reward = 0.0
        if self.shaped:  # a step closer +0.1, a step away -0.1: a loop earns nothing
            reward = 0.1 * (before - self.steps_left()) if valid else -0.1
        return StepResult([{"role": "user", "content": text}], reward=reward)

    def command(self, raw: str) -> tuple[str, bool]:
        """Carry out one command: (the observation, whether it was valid)."""
        words = raw.strip().lower().rstrip(".!").split()
        if not words:
            return "Say a command: go, take, put.", False
        verb, rest = words[0], words[1:]
        if verb in DIRS or verb in _ABBREV:
            verb, rest = "go", [verb]
        if verb == "go" and len(rest) == 1:
            d = _ABBREV.get(rest[0], rest[0])
            if d not in DIRS:
                return f"No direction {rest[0]}.", False
            if d not in self.world.doors[self.room]:
                return f"No door {d}. {self.describe()}", False  # where it still is: recover by reading
            self.room = self.world.doors[self.room][d]
            return self.describe(), True
        if verb == "look" and not rest:
            return self.describe(), True
        if verb == "take" and len(rest) == 1:
            obj = rest[0]
            if obj in self.floor[self.room]:
                self.floor[self.room].remove(obj)
            else:
                box = next((c for c, objs in self.inside.items()
                            if obj in objs and self.world.container_room[c] == self.room), None)
                if box is None:
                    return f"No {obj} here.", False
                self.inside[box].remove(obj)
            self.held.append(obj)
            return f"You take the {obj}.", True
        if verb == "put" and len(rest) == 3 and rest[1] in ("in", "into"):
            obj, box = rest[0], rest[2]
            if obj not in self.held:
                return f"You have no {obj}.", False
            if self.world.container_room.get(box) != self.room:
                return f"No {box} here.", False
            self.held.remove(obj)
            self.inside[box].append(obj)
            return f"You put the {obj} in the {box}.", True
        return "Unknown command. Try: go north, take key, put key in box.", False


@WORKLOADS.register("textworld")
class TextWorldWorkload(AgentWorkload):
    """The text world (see the module docstring); ``workload.params`` are ``TextWorldParams``."""

    Params = TextWorldParams

    def __init__(self, seed: int = 0, **params: Any):
        super().__init__(seed=seed, **params)
        p = self.params
        if p.width * p.height > len(ROOM_NAMES):
            raise ValueError(f"textworld workload: width * height is at most {len(ROOM_NAMES)} rooms")
        self.grid = (p.width, p.height, p.extra_doors, p.seed)
        #: (kind, difficulty) pairs no map of this grid has (e.g. a 4-step walk on 2x2)
        self._impossible: set[tuple[str, int]] = set()

    def environment(self) -> TextWorldEnv:
        return TextWorldEnv(self.grid, shaped=self.params.shaped, max_turns=self.params.max_turns)

    def world(self, task: Mapping[str, Any]) -> World:
        """The map of ``task``."""
        return world_of(*self.grid, task["layout"])

    def _draw(self, rng: random.Random, level: int) -> dict[str, Any]:
        """A random task of ``level`` expert steps: a kind that has such tasks, then maps, rooms and
        objects drawn until one fits."""
        kinds = [k for k in KINDS if level >= (2 if k == "put" else 1)]
        first = rng.choice(kinds)
        for kind in [first] + [k for k in kinds if k != first]:  # the others only if no map of this grid fits
            if (kind, level) in self._impossible:
                # the stream moves on as the failed search did (one layout per attempt): which
                # tasks are drawn must not depend on what this object found impossible before
                for _ in range(_ATTEMPTS):
                    rng.randrange(2**31)
                continue
            task = self._draw_kind(rng, level, kind)
            if task is not None:
                return task
            self._impossible.add((kind, level))
        p = self.params
        raise ValueError(f"textworld workload: no task on a {p.width}x{p.height} grid takes {level} steps; "
                         f"lower max_difficulty (now {p.max_difficulty}) or make the grid larger (width, height)")

    def _draw_kind(self, rng: random.Random, level: int, kind: str) -> dict[str, Any] | None:
        for _ in range(_ATTEMPTS):
            layout = rng.randrange(2**31)
            w = world_of(*self.grid, layout)
            if kind == "go":
                fits = [{"kind": kind, "start": s, "target": t} for s in w.rooms for t in w.rooms]
            else:
                fits = [{"kind": kind, "start": s, "from": r, **({"container": c} if kind == "put" else {})}
                        for s in w.rooms for r in w.rooms for c in (CONTAINERS if kind == "put" else ("",))]
            fits = [c for c in fits if expert_steps(w, c) == level]
            if not fits:
                continue
            core = rng.choice(fits)
            if kind != "go":
                core["object"] = rng.choice(OBJECTS)
            objects = [] if kind == "go" else [(core["object"], core["from"])]
            other = rng.choice([o for o in OBJECTS if o != core.get("object")])  # a distractor
            objects.append((other, rng.choice(w.rooms)))
            rng.shuffle(objects)
            return {"layout": layout, **core, "objects": [list(x) for x in objects],
                    "goal": goal_text(w, core), "difficulty": level}
        return None

    def tasks(self, split: str) -> list[dict[str, Any]]:
        """``num_train`` or ``num_test`` tasks of ``split``: one stream of random tasks, each in the
        split its hash says, difficulties in equal shares."""
        if split not in ("train", "eval"):
            raise ValueError(f"textworld workload: split must be 'train' or 'eval', got {split!r}")
        p = self.params
        rng = random.Random(f"textworld-tasks:{p.seed}")
        n = p.num_train if split == "train" else p.num_test
        out: list[dict[str, Any]] = []
        while len(out) < n:
            level = len(out) % p.max_difficulty + 1
            task = self._draw(rng, level)
            if _split_of(task, p) == split:
                out.append(task)
        random.Random(f"textworld-order:{p.seed}:{split}").shuffle(out)
        return out


def _dir_order(item: tuple[str, str]) -> int:
    return list(DIRS).index(item[0])


def _split_of(task: Mapping[str, Any], p: TextWorldParams) -> str:
    key = json.dumps({k: v for k, v in task.items() if k != "goal"}, sort_keys=True)
    return "eval" if is_held_out(key, p.seed, p.test_fraction) else "train"
