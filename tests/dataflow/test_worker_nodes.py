"""Several RaaS nodes on one worker (``rollout.nodes_per_worker``): the data layer knows each
by its own name and the worker it shares (heartbeat ``worker``), so draining or losing the
worker reaches every node on it and no other; the orchestrator reads the worst member's report
as the worker's."""

from __future__ import annotations

import asyncio

import pytest

from astraflow.runtime.workers import worker_report
from tests.dataflow.test_data_layer import make_layer


def test_drain_and_loss_of_a_worker_reach_its_nodes_only(tmp_path):
    layer = make_layer(tmp_path, prefetch_groups=20)

    async def go():
        for name, worker in (("w0.n0", "w0"), ("w0.n1", "w0"), ("w1.n0", "w1")):
            await layer.heartbeat(name, {"worker": worker})
            assert len(await layer.lease(name, 4)) == 4
        await layer.drain("w0")
        assert await layer.lease("w0.n1", 4) == [] and len(await layer.lease("w1.n0", 4)) == 4
        assert await layer.node_gone("w0") == 8  # both nodes' leases back in the queue
        assert layer.leases.nodes["w0.n0"]["gone"] and layer.leases.nodes["w0.n1"]["gone"]
        assert not layer.leases.nodes["w1.n0"].get("gone")
        assert sum(1 for n, _ in layer.leases.held.values() if n == "w1.n0") == 8

    asyncio.run(go())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["drain", "node_gone"])
def test_a_long_poll_drained_or_lost_while_it_waits_leases_nothing(tmp_path, monkeypatch, how):
    """The node's state is read again when its parked lease call wakes: tasks created while it
    waited (a gated layer's next iteration) are not leased to a node drained or declared gone
    meanwhile. The wait is held open by a gate until both have happened."""
    layer = make_layer(tmp_path)
    layer.budget = 0  # gated: no group until ``open_iteration``
    parked, go = asyncio.Event(), asyncio.Event()

    async def held_wait(seconds):
        parked.set()
        await go.wait()

    monkeypatch.setattr(layer, "_wait", held_wait)

    async def run():
        poll = asyncio.create_task(layer.lease("w0", 4, wait=30.0))
        await parked.wait()
        await getattr(layer, how)("w0")
        await layer.open_iteration(1)
        go.set()
        assert await asyncio.wait_for(poll, 5) == []
        assert not any(n == "w0" for n, _ in layer.leases.held.values())

    asyncio.run(run())


def test_the_worst_member_speaks_for_the_worker():
    reports = {"w0.n0": {"worker": "w0", "silent_s": 1.0, "error": None},
               "w0.n1": {"worker": "w0", "silent_s": 40.0, "error": "OSError: [Errno 28] full", "error_os": (28, "f")},
               "w1": {"silent_s": 2.0, "error": None}}
    assert worker_report(reports, "w0") == {"error": "OSError: [Errno 28] full", "error_os": (28, "f"), "silent_s": 40.0}
    assert worker_report(reports, "w1") == reports["w1"]
    assert worker_report(reports, "w2") == {}
    reports["w0.n0"].update(error="RuntimeError: boom")  # a full disk speaks first: it stops the run
    assert worker_report(reports, "w0")["error_os"] == (28, "f")
