"""The staleness bound as a window: a trainer takes sequences generated at most ``max_staleness``
versions before its own and never after it."""

from __future__ import annotations

import asyncio

from tests.dataflow.test_data_layer import Node, make_layer


def _alternating(task) -> float:
    return float(int(task.task_id.split("/")[1]) % 2)


def test_a_trainer_taken_back_trains_nothing_the_versions_moved_aside_generated(tmp_path):
    """Newer versions moved aside (the trainer resumes behind them): what their weights sampled
    is dropped as stale from the buffer and leaves the replay pool, never served with a
    negative staleness."""
    layer = make_layer(tmp_path, max_staleness=1, replay_ratio=0.25, admission="prefetch", prefetch_groups=8)

    async def go():
        node = Node(layer)
        for v in range(3):
            await node.roll(8, reward_of=_alternating, version=v)
            await layer.next_batch("p", v, timeout=5)
            await layer.published("p", v + 1, {"loss": 0.0})
        await node.roll(8, reward_of=_alternating, version=2)  # sampled by v2, then v2 and v3 are moved aside
        await layer.trainer_restarted("p", 1, restart=False)
        await node.roll(8, reward_of=_alternating, version=1)
        batch = await layer.next_batch("p", 1, timeout=5)
        assert [i.staleness for i in batch.items if i.staleness < 0] == []
        assert {it.oldest_version for it in layer.buffers.replay["p"]} <= {0, 1}

    asyncio.run(go())
