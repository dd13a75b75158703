"""A lost trainer replaced by a new one (``DataLayer.trainer_restarted``): the batches served to
the lost trainer that no committed version was trained on go back to the buffer and are served
again, never dropped as ``served_not_trained`` and never consumed twice; versions it committed
without reporting are recorded; a batch call it left pending serves nothing."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.dataflow.test_buffers import Rig
from tests.dataflow.test_data_layer import Node, make_layer, run


def _alternating(t) -> float:
    return float(int(t.task_id.split("/")[1]) % 2)


def test_a_batch_served_to_a_lost_trainer_is_served_again_not_dropped_and_trained_once(tmp_path):
    layer = make_layer(tmp_path)

    async def go():
        node = Node(layer)
        await node.roll(16, reward_of=_alternating)
        first = await layer.next_batch("p", 0, timeout=5)
        await layer.published("p", 1, {"loss": 0.0})
        lost = await layer.next_batch("p", 1, timeout=5)  # the trainer dies training on it
        assert layer.counts["p"]["consumed"] == 8  # served is not trained on: counted at commit
        out = await layer.trainer_restarted("p", 1)  # v1 is the newest committed version
        assert out == {"put_back": 8, "recovered": []}
        assert {layer.ledger.state_of(i.task_id) for i in lost.items} == {"completed"}  # not ended
        assert layer.counts["p"]["consumed"] == 8 and layer.counts["p"]["put_back"] == 8
        assert (await layer.state())["buffers"]["p"] == 8
        again = await layer.next_batch("p", 1, timeout=5)  # the new trainer asks for v1
        assert sorted(i.task_id for i in again.items) == sorted(i.task_id for i in lost.items)
        await layer.published("p", 2, {"loss": 0.0})
        assert {layer.ledger.state_of(i.task_id) for i in again.items} == {"consumed"}
        summary = await layer.finish()
        assert summary["open"] == 0 and "served_not_trained" not in summary["dropped_by_reason"]
        assert summary["states"]["consumed"] == 16  # each task once: 2 batches of 8 distinct tasks
        assert {i.task_id for i in first.items}.isdisjoint(i.task_id for i in again.items)

    run(go())


def test_a_version_committed_but_never_reported_is_recorded_on_restart(tmp_path):
    layer = make_layer(tmp_path)

    async def go():
        node = Node(layer)
        await node.roll(16, reward_of=_alternating)
        await layer.next_batch("p", 0, timeout=5)
        await layer.published("p", 1, {"loss": 0.0})
        trained = await layer.next_batch("p", 1, timeout=5)  # v2 committed, then the trainer died
        out = await layer.trainer_restarted("p", 2)
        assert out == {"put_back": 0, "recovered": [2]}
        assert layer.versions["p"] == 2
        assert {layer.ledger.state_of(i.task_id) for i in trained.items} == {"consumed"}
        await layer.close()
        steps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [(x["step"], x.get("recovered", False)) for x in steps] == [(1, False), (2, True)]

    run(go())


def test_a_batch_call_the_lost_trainer_left_pending_serves_nothing(tmp_path):
    layer = make_layer(tmp_path)

    async def go():
        node = Node(layer)
        dangling = asyncio.ensure_future(layer.next_batch("p", 0, timeout=5))  # waits: nothing rolled
        await asyncio.sleep(0.05)
        await layer.trainer_restarted("p", 0)
        await node.roll(8, reward_of=_alternating)
        with pytest.raises(RuntimeError, match="was replaced"):
            await dangling
        assert layer.counts["p"]["consumed"] == 0 and not layer.buffers.serving["p"]
        batch = await layer.next_batch("p", 0, timeout=5)  # the new trainer gets those sequences
        assert len(batch) == 8
        await layer.published("p", 1, {"loss": 0.0})
        summary = await layer.finish()  # the tasks never leased end as run_ended
        assert summary["states"]["consumed"] == 8 and set(summary["dropped_by_reason"]) == {"run_ended"}

    run(go())


def test_put_back_items_keep_their_groups_and_can_still_go_stale():
    rig = Rig(max_staleness=1)
    rig.group([0.0, 1.0])
    rig.group([1.0, 0.0])
    batch, _ = rig.serve(0, 3)  # one whole group and half of the next
    back = rig.buffers.put_back("p", 0)
    assert len(back) == 3 and not rig.buffers.serving["p"]
    assert [len(g.items) for g in rig.buffers.ready["p"]] == [2, 2]  # the halves rejoined
    assert [g.ingest_seq for g in rig.buffers.ready["p"]] == [1, 2]
    assert rig.buffers.staleness_hist["p"] == {} and rig.buffers.counts["p"]["consumed"] == 0
    assert rig.buffers.drop_stale("p", version=2) == 0  # two versions later: stale, counted
    assert rig.ledger.dropped_by_reason == {"stale": 4}
