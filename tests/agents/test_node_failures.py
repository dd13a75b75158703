"""A RaaS node running agentic episodes: an environment that raises fails that episode only
(the data layer is told, to requeue it), the node keeps serving, nothing stays in flight."""

from __future__ import annotations

import asyncio

import pytest

from astraflow.contracts import RolloutTask
from astraflow.rollout.engine import SamplingParams
from astraflow.rollout.hf_engine import HFEngine
from astraflow.rollout.workflows import make_workflow
from tests.agents.toy import BrokenWorkload
from tests.rollout.test_node_writer import _node


@pytest.mark.timeout(120)
def test_a_raising_environment_fails_one_episode_and_the_node_goes_on(tmp_path, tiny_model):
    node, dl = _node(tmp_path)
    node.engines = {"p": HFEngine(str(tiny_model), version=0)}
    node.workflow = make_workflow("agent", BrokenWorkload(), SamplingParams(max_new_tokens=8), "n0")
    bad = RolloutTask(task_id="g0/0", group_id="g0", policies=("p",), workflow="agent", prompt={"key": "k33"})
    good = RolloutTask(task_id="g1/0", group_id="g1", policies=("p",), workflow="agent", prompt={"key": "k1"})

    async def run():
        node._slot_free = asyncio.Event()
        node._finished, node._finished_event = [], asyncio.Event()
        for t in (bad, good):
            node.inflight[t.task_id] = t
        await asyncio.gather(node._episode(bad), node._episode(good))

    asyncio.run(run())
    node.engines["p"].close()
    assert [t for t, _ in dl.failed] == ["g0/0"] and "EpisodeError" in dl.failed[0][1]
    assert "KeyError" in dl.failed[0][1] and node.counters["failed"] == 1
    assert [t.task_id for t, _ in node._finished] == ["g1/0"]
    assert not node.inflight and not node.draining and node.error is None
