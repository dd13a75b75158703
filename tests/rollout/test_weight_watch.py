"""A node's weight watcher meeting a failure that lasts (a damaged version in the weight store):
it keeps serving and polling, and logs the failure once, then a line a minute, not every poll."""

from __future__ import annotations

import asyncio

from astraflow.rollout import node as node_mod
from tests.rollout.test_node_writer import _node


class _Damaged:
    def __init__(self):
        self.polls = 0

    def poll(self) -> int:
        self.polls += 1
        if self.polls >= 40:
            return 1  # the version was restored: it loads
        raise RuntimeError("reading the checkpoint v00000017 failed (a file of it may be damaged)")


def test_a_lasting_failure_is_logged_once_then_each_minute_and_polling_goes_on(tmp_path, caplog, monkeypatch):
    node, _ = _node(tmp_path, weight_poll_seconds=0.005)
    node.puller = _Damaged()

    async def watch():
        node._new_weights = asyncio.Event()
        watcher = asyncio.create_task(node._watch_weights())
        await asyncio.wait_for(node._new_weights.wait(), 30)
        watcher.cancel()

    with caplog.at_level("WARNING", logger=node_mod.log.name):
        asyncio.run(watch())
    said = [r for r in caplog.records if "weight store" in r.getMessage()]
    assert node.puller.polls == 40 and node.counters["weight_loads"] == 1
    assert len(said) == 1 and said[0].exc_info is not None  # the traceback once, not 39 of them
    caplog.clear()
    monkeypatch.setattr(node_mod, "REPEAT_LOG_S", 0.0)  # past a minute: a line again, without the traceback
    node.puller = _Damaged()
    with caplog.at_level("WARNING", logger=node_mod.log.name):
        asyncio.run(watch())
    still = [r for r in caplog.records if "still fails" in r.getMessage()]
    assert len(still) == 38 and all(r.exc_info is None for r in still)
