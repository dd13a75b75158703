"""The text world: deterministic maps and tasks, i.i.d. disjoint splits, exits in the
observations, an expert that always succeeds, invalid commands as observations, shaped rewards
(its CLI run: ``tests/e2e/test_agent_cli.py``)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import numpy as np
import pytest

from astraflow.agents.chat import ChatRenderer
from astraflow.agents.env import Action, signature_problems
from astraflow.agents.episode import run_agent_episode
from astraflow.models import build_tokenizer
from astraflow.workloads.base import make_workload, workload_class
from astraflow.workloads.textworld import TextWorldEnv, TextWorldWorkload
from tests.agents.test_episode import Gen, scripted


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _live_scripted(tok, env, turns):
    """A ``generate`` that writes the expert's next command each turn (asked once per turn)."""

    async def generate(tokens, max_new):
        turns.append(env.expert_action())
        ids = tok.encode(turns[-1], add_special_tokens=False) + [tok.eos_token_id]
        n = len(ids)
        return Gen(np.array(ids), np.zeros(n, np.float32), np.zeros(n, np.int32), "stop")

    generate.turns = turns
    return generate


def play(tok, wl, task, commands=None):
    """One episode of ``task``: the expert's commands, or ``commands`` in order."""
    env = wl.environment()
    gen = _live_scripted(tok, env, []) if commands is None else scripted(tok, commands)
    log = asyncio.run(run_agent_episode(gen, ChatRenderer(tok), env, task, wl.limits(32)))
    return log, env


def test_registered_and_fits_the_contract():
    assert workload_class("textworld") is TextWorldWorkload
    assert signature_problems(TextWorldEnv) == []


def test_world_and_tasks_are_deterministic_by_seed():
    a, b, c = (make_workload("textworld", {}, s) for s in (0, 0, 1))
    assert a.tasks("train") == b.tasks("train") and a.tasks("eval") == b.tasks("eval")
    assert a.tasks("train") != c.tasks("train")
    task = a.tasks("train")[0]
    assert a.world(task).doors == b.world(task).doors
    # each task has its own map; the room names keep their grid cells for a seed
    worlds = [a.world(t) for t in a.tasks("train")[:20]]
    assert len({str(w.doors) for w in worlds}) > 10 and len({str(w.cell) for w in worlds}) == 1
    # every room reachable from every other
    assert all(len(w.dist[r]) == len(w.rooms) for w in worlds for r in w.rooms)


def test_splits_are_disjoint_draws_of_one_generator():
    wl = make_workload("textworld", {"num_train": 500, "num_test": 200}, 0)
    key = lambda t: json.dumps(t, sort_keys=True)  # noqa: E731
    train, held = {key(t) for t in wl.tasks("train")}, {key(t) for t in wl.tasks("eval")}
    assert len(train) == 500 and len(held) == 200 and not train & held
    for split in ("train", "eval"):
        tasks = wl.tasks(split)
        assert {t["difficulty"] for t in tasks} == {1, 2, 3, 4}
        assert {t["kind"] for t in tasks} == {"go", "take", "put"}
    with pytest.raises(ValueError, match="split"):
        wl.tasks("test")


def test_observations_list_the_exits_with_the_rooms_behind_them():
    wl = make_workload("textworld", {}, 0)
    env = wl.environment()
    task = wl.tasks("eval")[0]
    first = asyncio.run(env.reset(task))[0]["content"]
    assert first.startswith(task["goal"] + "\nIn " + task["start"] + ". Exits: ")
    exits = env.describe().split("Exits: ")[1].split(".")[0].split(", ")
    doors = env.world.doors[env.room]
    assert exits == [f"{d[0]} {doors[d]}" for d in ("north", "south", "east", "west") if d in doors]
    d, n = next(iter(env.world.doors[env.room].items()))
    assert env.command(f"go {d[0]}") == (env.describe(), True) and env.room == n


def test_the_expert_succeeds_in_exactly_difficulty_steps_with_compact_episodes(tok):
    wl = make_workload("textworld", {"num_train": 150, "num_test": 60}, 3)
    for task in wl.tasks("train") + wl.tasks("eval"):
        log, _ = play(tok, wl, task)
        assert log.done and log.success == 1.0 and log.final_reward == 1.0, (task, log.turns)
        assert sum(t["kind"] == "model" for t in log.turns) == task["difficulty"]
        assert len(log.tokens) < 400


def test_invalid_commands_are_observations_not_errors(tok):
    wl = make_workload("textworld", {"max_turns": 6}, 0)
    task = next(t for t in wl.tasks("eval") if t["kind"] == "put")
    walls = [d for d in ("north", "south", "east", "west") if d not in wl.world(task).doors[task["start"]]]
    bad = ["dance", "", f"go {walls[0]}" if walls else "go up", "take unicorn", "put coin in sock", "go"]
    log, env = play(tok, wl, task, bad)
    replies = [t["messages"][0]["content"] for t in log.turns if t["kind"] == "env"]
    assert replies[0].startswith("Unknown command") and replies[1].startswith("Say a command")
    assert replies[3] == "No unicorn here." and replies[4] == "You have no coin."
    if walls:  # a move into a wall says where the agent still is
        assert replies[2] == f"No door {walls[0]}. {env.describe()}" and "Exits: " in replies[2]
    assert log.done and log.success == 0.0 and env.room == task["start"]  # the world ended it: out of turns


def test_shaped_rewards_reward_progress_and_punish_invalid_commands(tok):
    wl = make_workload("textworld", {"shaped": True}, 0)
    task = next(t for t in wl.tasks("train") if t["kind"] == "put" and t["difficulty"] == 4)
    log, _ = play(tok, wl, task)
    assert log.success == 1.0 and log.turn_rewards == [0.1, 0.1, 0.1] and log.reward == pytest.approx(1.3)
    log, _ = play(tok, wl, task, ["jump", "jump", "jump", "jump", "jump", "jump"])
    assert log.turn_rewards == [-0.1] * 5 and log.final_reward == 0.0
    plain = make_workload("textworld", {}, 0)
    log, _ = play(tok, plain, task)
    assert log.turn_rewards == [] and log.reward == 1.0


def test_commands_change_the_world():
    wl = make_workload("textworld", {}, 0)
    env = wl.environment()
    task = next(t for t in wl.tasks("train") if t["kind"] == "put" and t["start"] == t["from"])
    asyncio.run(env.reset(task))
    obj, box = task["object"], task["container"]
    assert obj in env.describe()
    assert env.command(f"take {obj}") == (f"You take the {obj}.", True)
    assert obj not in env.describe() and env.held == [obj]
    room = wl.world(task).container_room[box]
    env.room = room
    res = asyncio.run(env.step(Action(f"put {obj} in {box}")))
    assert res.done and res.reward == 1.0 and res.info == {"success": 1.0}


def test_a_small_grid_draws_what_it_can_and_refuses_what_it_cannot():
    small = TextWorldWorkload(width=2, height=2, num_train=40, num_test=8)  # no walk of 4 steps on 2x2
    tasks = small.tasks("train")
    assert sorted(Counter(t["difficulty"] for t in tasks)) == [1, 2, 3, 4]
    assert all(t["kind"] != "go" for t in tasks if t["difficulty"] == 4)
    with pytest.raises(ValueError, match="no task on a 2x1 grid takes 5 steps; lower max_difficulty"):
        TextWorldWorkload(width=2, height=1, max_difficulty=5, num_train=10, num_test=2).tasks("train")


def test_shaped_rewards_pay_nothing_for_walking_away_and_back():
    """A step away costs what a step closer pays: a loop that never finishes earns no return."""
    from astraflow.agents.env import Action
    from astraflow.workloads.textworld import _opposite

    wl = make_workload("textworld", {"shaped": True}, 0)

    async def away_and_back(task):
        env = wl.environment()
        await env.reset(task)
        goal, here = env.target_room(), env.room
        farther = [d for d, n in env.world.doors[here].items() if env.world.dist[goal][n] > env.world.dist[goal][here]]
        if not farther:
            return None
        rewards = [(await env.step(Action(text=f"go {d[0]}"))).reward for d in (farther[0], _opposite(farther[0]))]
        return rewards, env.room == here

    found = [r for t in wl.tasks("train")[:40] if (r := asyncio.run(away_and_back(t)))]
    assert found and all(back for _, back in found)
    assert all(rewards == [pytest.approx(-0.1), pytest.approx(0.1)] for rewards, _ in found)


def test_tasks_do_not_depend_on_what_the_workload_drew_before():
    """On a grid where some (kind, length) pairs have no task, the pairs found impossible are
    remembered: the tasks drawn must not depend on that history (two calls, or another split
    first, give the same tasks)."""
    kw = dict(width=2, height=1, max_difficulty=3, num_train=30, num_test=10)
    w = TextWorldWorkload(**kw)
    first = w.tasks("train")
    assert w._impossible and w.tasks("train") == first
    other = TextWorldWorkload(**kw)
    other.tasks("eval")
    assert other.tasks("train") == first


def test_a_task_longer_than_an_episode_is_refused():
    with pytest.raises(ValueError, match="max_difficulty 7 is more than max_turns 6"):
        TextWorldWorkload(max_difficulty=7)
    assert TextWorldWorkload(max_difficulty=7, max_turns=7).params.max_difficulty == 7
