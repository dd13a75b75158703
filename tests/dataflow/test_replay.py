"""Replay: consumed samples mixed into later batches, held to the staleness bound, and taken back
with a batch that never trained."""

from __future__ import annotations

from tests.dataflow.test_data_layer import Node, make_layer, run


def test_replay_mixes_consumed_samples_and_records_them(tmp_path):
    layer = make_layer(tmp_path, replay_ratio=0.5)

    async def go():
        node = Node(layer)
        await node.roll(8, reward_of=lambda t: float(int(t.task_id[-1]) % 2))
        first = await layer.next_batch("p", 0, timeout=5)
        assert not any(i.replayed for i in first.items)  # nothing to replay yet
        await layer.published("p", 1)
        await node.roll(8, reward_of=lambda t: float(int(t.task_id[-1]) % 2), version=1)
        second = await layer.next_batch("p", 1, timeout=5)
        replayed = [i for i in second.items if i.replayed]
        assert len(second) == 8 and len(replayed) == 4
        assert {i.task_id for i in replayed} <= {i.task_id for i in first.items}
        assert all(i.staleness == 1 for i in replayed)
        assert (await layer.state())["counts"]["p"]["replayed"] == 0  # counted once trained on
        await layer.published("p", 2)
        assert (await layer.state())["counts"]["p"]["replayed"] == 4

    run(go())


def test_a_batch_asked_for_again_is_neither_replayed_nor_counted_as_consumed(tmp_path):
    """The trainer asks again at the same version: the first batch never trained. Its rows are
    served again (put back first), not replayed, and counted as consumed once."""
    layer = make_layer(tmp_path, replay_ratio=0.5)

    async def go():
        node = Node(layer)
        await node.roll(8)
        lost = await layer.next_batch("p", 0, timeout=5)
        await node.roll(8)
        again = await layer.next_batch("p", 0, timeout=5)
        assert not any(i.replayed for i in again.items)  # nothing was consumed: nothing to replay
        assert {i.task_id for i in lost.items} <= {i.task_id for i in again.items}
        assert "consumed" not in (await layer.state())["counts"]["p"]  # served twice, trained on never
        await layer.published("p", 1)
        state = await layer.state()
        assert state["counts"]["p"]["consumed"] == 8
        assert sum(state["staleness_hist"]["p"].values()) == 8

    run(go())


def test_replayed_samples_are_held_to_the_staleness_bound(tmp_path):
    layer = make_layer(tmp_path, replay_ratio=0.5, max_staleness=1)

    async def go():
        node = Node(layer)
        worst, replayed = 0, []
        for v in range(5):
            await node.roll(8, version=v)
            batch = await layer.next_batch("p", v, timeout=5)
            assert len(batch) == 8
            worst = max([worst] + [i.staleness for i in batch.items])
            replayed.append(sum(i.replayed for i in batch.items))
            await layer.published("p", v + 1)
        # the pool runs dry when all it holds is past the bound: that batch replays nothing
        assert worst == 1 and replayed[:3] == [0, 4, 4] and 0 in replayed[3:]

    run(go())


def test_the_replays_of_a_batch_never_trained_are_taken_back_with_it(tmp_path):
    """A batch asked for again at its version, or put back for a replaced trainer, was never
    trained: neither its new rows nor its replayed ones count."""
    def _alternating(task):
        return float(int(task.task_id.split("/")[1]) % 2)

    layer = make_layer(tmp_path, replay_ratio=0.25)  # 2 replayed rows a batch once the pool has them

    async def go():
        node = Node(layer)
        await node.roll(8, reward_of=_alternating)
        await layer.next_batch("p", 0, timeout=5)
        await layer.published("p", 1, {})
        await node.roll(16, reward_of=_alternating, version=1)
        first = await layer.next_batch("p", 1, timeout=5)
        assert sum(i.replayed for i in first.items) == 2 and layer.counts["p"]["replayed"] == 0
        again = await layer.next_batch("p", 1, timeout=5)  # the first never reached training
        assert sum(i.replayed for i in again.items) == 2
        assert (layer.counts["p"]["consumed"], layer.counts["p"]["replayed"]) == (8, 0)
        await layer.trainer_restarted("p", 1)  # a replaced trainer: the batch goes back
        assert (layer.counts["p"]["consumed"], layer.counts["p"]["replayed"]) == (8, 0)
        again = await layer.next_batch("p", 1, timeout=5)
        await layer.published("p", 2)  # trained on: its new rows and its replays count, once
        assert (layer.counts["p"]["consumed"], layer.counts["p"]["replayed"]) == (8 + 6, 2)

    run(go())
