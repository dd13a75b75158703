"""Several RaaS nodes on one worker (``rollout.nodes_per_worker``): the data layer knows each
by its own name and the worker it shares (heartbeat ``worker``), so draining or losing the
worker reaches every node on it and no other; the orchestrator reads the worst member's report
as the worker's."""

from __future__ import annotations

import asyncio

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


def test_the_worst_member_speaks_for_the_worker():
    reports = {"w0.n0": {"worker": "w0", "silent_s": 1.0, "error": None},
               "w0.n1": {"worker": "w0", "silent_s": 40.0, "error": "OSError: [Errno 28] full", "error_os": (28, "f")},
               "w1": {"silent_s": 2.0, "error": None}}
    assert worker_report(reports, "w0") == {"error": "OSError: [Errno 28] full", "error_os": (28, "f"), "silent_s": 40.0}
    assert worker_report(reports, "w1") == reports["w1"]
    assert worker_report(reports, "w2") == {}
    reports["w0.n0"].update(error="RuntimeError: boom")  # a full disk speaks first: it stops the run
    assert worker_report(reports, "w0")["error_os"] == (28, "f")
