"""What a node does with a user's code that misbehaves: rewards that hang do not starve the healthy
ones; a workload's reward that raises or returns no number, and a workflow that returns no
trajectory, are named; a failed episode's traceback is logged once per reason; something that
blocks the node's event loop is logged with the stack it is stuck in."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from types import SimpleNamespace

import pytest

from astraflow.contracts import RolloutTask
from astraflow.rollout.failure_log import FailureLog
from astraflow.rollout.node_episodes import NodeEpisodes
from astraflow.rollout.workflows import RewardTimeout, WorkflowBase
from astraflow.workloads.rewards import RewardError, UserReward


class Hangs:
    """A workload whose reward hangs on ``"hang"`` until ``release`` is set."""

    def __init__(self):
        self.release = threading.Event()

    def reward(self, completion, payload):
        if completion == "hang":
            self.release.wait(30)
        return 1.0


@pytest.mark.timeout(60)
def test_healthy_rewards_are_scored_within_their_deadline_however_many_rewards_hung():
    """Batches of calls, a third of them hanging, more hung calls in all than the reward threads:
    every healthy call is still scored, every hung one fails at its deadline."""
    w = Hangs()
    flow = WorkflowBase(workload=w, sampling=None, node="n", reward_timeout_s=0.3)

    async def one(text):
        try:
            return await flow.score(text, {})
        except RewardTimeout:
            return "timeout"

    async def go():
        out = []
        for _ in range(6):
            texts = ["hang" if i % 3 == 0 else "ok" for i in range(21)]
            out += zip(texts, await asyncio.gather(*(one(t) for t in texts)))
        return out

    try:
        out = asyncio.run(go())
    finally:
        w.release.set()
    assert sum(t == "hang" for t, _ in out) > 32  # more than the reward threads
    assert all(r == 1.0 for t, r in out if t == "ok"), [r for t, r in out if t == "ok"]
    assert all(r == "timeout" for t, r in out if t == "hang")


class Picky:
    """A user's workload: its reward raises or returns None."""

    def reward(self, completion, payload):
        if completion == "raise":
            return payload["missing"]
        return None if completion == "none" else 1.0


def test_a_workload_reward_that_raises_or_returns_none_is_named():
    flow = WorkflowBase(workload=Picky(), sampling=None, node="n")
    with pytest.raises(RewardError, match=r"^Picky\.reward raised KeyError: 'missing'$"):
        asyncio.run(flow.score("raise", {}))
    with pytest.raises(RewardError, match=r"^Picky\.reward returned None, not a number$"):
        asyncio.run(flow.score("none", {}))
    assert asyncio.run(flow.score("ok", {})) == 1.0


def test_a_dataset_reward_error_is_not_named_twice_and_stats_must_be_a_pair():
    def mine(completion, answer, payload):
        raise ValueError("bad")

    class Dataset:
        def reward(self, completion, payload):
            return UserReward("mypkg:mine", mine)(completion, "1", payload)

        def reward_and_stats(self, completion, payload):
            return None

    flow = WorkflowBase(workload=Dataset(), sampling=None, node="n")
    with pytest.raises(RewardError, match=r"^reward mypkg:mine raised ValueError: bad$"):
        asyncio.run(flow.score("x", {}))
    with pytest.raises(RewardError, match=r"^Dataset\.reward_and_stats returned None, not a \(reward"):
        asyncio.run(flow.score_and_stats("x", {}))


class Episodes(NodeEpisodes):
    """Just enough of a node to run ``_episode``: failures are recorded, not sent."""

    def __init__(self, workflow):
        self.workflow, self.engines = workflow, {}
        self.cfg = SimpleNamespace(episode_timeout_s=10)
        self.counters = {"failed": 0}
        self.inflight, self.failed = {}, []
        self._recovery = None
        self._failure_log = FailureLog("n0")

    async def _fail(self, task, reason):
        self.failed.append(reason)

    async def run(self, n):
        self._slot_free = asyncio.Event()
        for i in range(n):
            await self._episode(_task(i))


def _task(i):
    return RolloutTask(task_id=f"g/{i}", group_id="g", policies=("p",), workflow="mine", prompt={}, kind="train")


class NoTrajectory:
    async def run_episode(self, engines, task):
        return None


class Broken:
    """Fails with the same reason twice, then another, then the first again."""

    def __init__(self):
        self.n = 0

    async def run_episode(self, engines, task):
        self.n += 1
        if self.n == 3:
            raise ValueError("another reason")
        raise KeyError("missing")


def test_a_run_episode_that_returns_none_is_named():
    node = Episodes(NoTrajectory())
    asyncio.run(node.run(1))
    assert node.failed == ["TypeError: NoTrajectory.run_episode returned None, not a Trajectory "
                           "(build one with astraflow.contracts.Trajectory)"]

    class Based(WorkflowBase):
        async def run_episode(self, engines, task):
            return None

    node = Episodes(Based(workload=None, sampling=None, node="n"))
    asyncio.run(node.run(1))
    assert node.failed[0].endswith("(build one with self.trajectory(...))")


def test_a_failure_reason_is_logged_with_its_traceback_once(caplog):
    node = Episodes(Broken())
    with caplog.at_level(logging.WARNING, logger="astraflow.rollout"):
        asyncio.run(node.run(4))
        node._failure_log.flush()  # as the node does when it stops
    said = [r for r in caplog.records if "failed" in r.getMessage()]
    assert [r.exc_info is not None for r in said] == [True, True, False]
    last = said[2].getMessage()
    assert last.startswith("node n0: 2 more episodes failed in the last"), last
    assert last.endswith(f"s: KeyError raised at {__file__}:{Broken.run_episode.__code__.co_firstlineno + 4}"), last
    assert "raise KeyError" in caplog.text  # the user's frame is in the log


def user_blocking_step():
    time.sleep(1.5)


def test_a_blocked_event_loop_is_logged_with_the_stack_it_is_stuck_in(caplog):
    from astraflow.rollout.loop_watchdog import unwatch_loop, watch_loop

    async def node():
        dog = watch_loop("n0", stall_s=0.5)
        await asyncio.sleep(0.1)
        user_blocking_step()
        await asyncio.sleep(0.2)  # the loop runs again
        unwatch_loop(dog, "n0")
        return dog

    with caplog.at_level(logging.WARNING, logger="astraflow.rollout"):
        dog = asyncio.run(node())
    dog._thread.join(2)
    assert not dog._thread.is_alive()  # it stops with the last node on its loop
    stuck = [r.getMessage() for r in caplog.records if "has not run for" in r.getMessage()]
    assert len(stuck) == 1 and "user_blocking_step" in stuck[0] and "time.sleep(1.5)" in stuck[0], stuck
    assert dog.stalls == 1


@pytest.mark.timeout(120)
def test_a_node_whose_step_blocks_its_loop_logs_where(tmp_path, tiny_model, caplog, monkeypatch):
    """A workflow that calls ``time.sleep`` in its ``async def``: the node's log names the stall and
    the blocking line; the watchdog ends with the node."""
    import astraflow.rollout.loop_watchdog as watchdog
    from astraflow.rollout.workflows import SingleTurn
    from tests.rollout.test_episode_failures import _rig, _wait

    class Sleepy(SingleTurn):
        slept = False

        async def run_episode(self, engines, task):
            if not Sleepy.slept:
                Sleepy.slept = True
                time.sleep(1.5)  # blocks the node's loop
            return await super().run_episode(engines, task)

    monkeypatch.setattr(watchdog, "STALL_S", 0.5)
    with caplog.at_level(logging.WARNING, logger="astraflow.rollout"):
        _, dl, node, _ = _rig(tmp_path, tiny_model, Sleepy)
        try:
            _wait("the stall to be logged",
                  lambda: "runs again after" in caplog.text and "time.sleep(1.5)" in caplog.text)
        finally:
            node.stop(timeout=10)
            dl.close()
    # a loaded machine may stall the loop elsewhere too: the blocking step is reported once, where it blocks
    stuck = [m for r in caplog.records if "has not run for" in (m := r.getMessage()) and "time.sleep(1.5)" in m]
    assert len(stuck) == 1 and stuck[0].startswith("node n0:"), stuck
    assert not any(t.name == "raas-loop-watchdog" and t.is_alive() for t in threading.enumerate())
