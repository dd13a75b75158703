"""Batches served by reference: the data layer names the rows and reads no token array; the
trainer's side (``astraflow.training.rows``) reads them from the store and makes the same batch
the data layer used to make; a row that cannot be read fails loudly, named, and the batch stays
served (not consumed) until a trainer commits a version trained on it."""

from __future__ import annotations

import asyncio
import pickle
import shutil
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from astraflow.batches import BatchRefs
from astraflow.contracts import sequence_from_stored
from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.layer import DataLayer
from astraflow.training.rows import BatchRows, RowsUnreadable
from astraflow.transport import Packed
from astraflow.workloads.config import EvalConfig, WorkloadConfig
from storage.trajectories import reader as store_reader

from tests.dataflow.helpers import make_trajectory, store_and_ref


def _layer(tmp_path, **df) -> DataLayer:
    """A data layer over a store on disk (what a run uses: nodes and trainers in other processes)."""
    return DataLayer(
        dataflow=DataflowConfig(batch_size=8, **df),
        workload=WorkloadConfig(name="math", params={"digits": 1, "num_test": 10}, group_size=4,
                                eval=EvalConfig(every=0)),
        policies=["p"], store_url=str(tmp_path / "trajectories"), metrics_path=None, max_steps=5,
    )


async def _roll(layer: DataLayer, n: int, node: str = "n0") -> None:
    tasks = await layer.lease(node, n)
    trajs = [make_trajectory(t, float(int(t.task_id.split("/")[1]) % 2), node=node, n_gen=3 + i % 4)
             for i, t in enumerate(tasks)]
    await layer.complete(store_and_ref(layer.store.writer(node), trajs))


@pytest.fixture
def store_reads(monkeypatch):
    """Counts what the trajectory store reads in this process, per array (a spy on the store's
    own read path: every call goes through to the real one)."""
    counts: Counter = Counter()
    rows, read = store_reader.SegmentView.rows, store_reader.TrajectoryStore.read

    def counted_rows(self, name, start, stop):
        counts[name] += 1
        return rows(self, name, start, stop)

    def counted_read(self, refs):
        counts["read"] += 1
        return read(self, refs)

    monkeypatch.setattr(store_reader.SegmentView, "rows", counted_rows)
    monkeypatch.setattr(store_reader.TrajectoryStore, "read", counted_read)
    return counts


def test_the_data_layer_serves_without_reading_rows_and_the_trainer_side_reads_them(tmp_path, store_reads):
    layer = _layer(tmp_path, replay_ratio=0.5)

    async def go():
        await _roll(layer, 8)
        store_reads.clear()
        first = await layer.next_batch("p", 0, timeout=5)
        await layer.published("p", 1)
        await _roll(layer, 4)
        second = await layer.next_batch("p", 1, timeout=5)  # 4 new rows, 4 replayed
        return first, second

    first, second = asyncio.run(go())
    assert not store_reads, f"the data layer read from the store while serving: {dict(store_reads)}"
    assert isinstance(first, BatchRefs) and len(first) == 8 and sum(i.replayed for i in second.items) == 4

    # what crosses the actor call is small and comes back whole
    wire = pickle.loads(pickle.dumps(Packed([second])))[0]
    assert [(i.ref, i.task_id, i.reward, i.staleness, i.replayed, i.group_mean) for i in wire.items] == \
        [(i.ref, i.task_id, i.reward, i.staleness, i.replayed, i.group_mean) for i in second.items]

    rows = BatchRows(str(tmp_path / "trajectories"))
    batch = rows.batch(second)
    assert store_reads["tokens"] >= 1  # the trainer's side read them
    stored = {r.task_id: r for r in layer.store.read([i.ref for i in second.items])}
    assert [i.task_id for i in batch.items] == [i.task_id for i in second.items]
    for item, ref in zip(batch.items, second.items):
        want = sequence_from_stored(stored[item.task_id])
        assert item.sequence == want and item.sequence.reward == ref.reward
        assert np.array_equal(item.loss_mask, want.loss_mask & (want.policy_ids == 0))
        assert (item.group_mean, item.group_std, item.group_size, item.staleness, item.replayed) == \
            (ref.group_mean, ref.group_std, ref.group_size, ref.staleness, ref.replayed)
        assert item.advantage == pytest.approx(ref.advantage)
    assert batch.metrics["response_tokens_mean"] == pytest.approx(
        np.mean([i.loss_mask.sum() for i in batch.items if not i.replayed]))
    assert batch.metrics["reward_mean"] == pytest.approx(
        np.mean([i.sequence.reward for i in batch.items if not i.replayed]))


def test_a_stored_row_that_breaks_the_sequence_rules_fails_the_batch_as_a_sequence_would(tmp_path):
    """Rows are checked for the whole batch at once; a row no ``Sequence`` could hold (a loss on
    a token no policy generated, written to the store behind the nodes' back) fails the batch
    with the sequence's own error, not quietly."""
    layer = _layer(tmp_path)

    async def go():
        await _roll(layer, 8)
        return await layer.next_batch("p", 0, timeout=5)

    served = asyncio.run(go())
    rows = BatchRows(str(tmp_path / "trajectories"))
    good = rows.batch(served)
    row = layer.store.read([served.items[3].ref])[0]
    bad = replace(row, loss_mask=np.ones_like(row.loss_mask))  # the prompt's tokens too
    [ref] = layer.store.writer("forger").write([bad])
    forged = replace(served, items=served.items[:3] + (replace(served.items[3], ref=ref),) + served.items[4:])
    with pytest.raises(ValueError, match="loss_mask marks a token that no policy generated"):
        rows.batch(forged)
    assert rows.batch(served).items[3].sequence == good.items[3].sequence


def test_a_row_that_cannot_be_read_fails_named_and_the_batch_is_served_again(tmp_path):
    layer = _layer(tmp_path)

    async def go():
        await _roll(layer, 4, node="n0")
        await _roll(layer, 4, node="n1")
        served = await layer.next_batch("p", 0, timeout=5)
        shutil.rmtree(tmp_path / "trajectories" / "segments" / "n1")  # one node's segment is gone
        with pytest.raises(RowsUnreadable) as err:
            BatchRows(str(tmp_path / "trajectories")).batch(served)
        lost = [i for i in served.items if i.ref.segment == "n1"]
        msg = str(err.value)
        assert f"{len(lost)} of its 8 rows" in msg and f"n1[{lost[0].ref.index}] (task {lost[0].task_id})" in msg
        assert "n0[" not in msg
        # nothing trained on it: not consumed; the replaced trainer gets every row back
        assert {layer.ledger.state_of(i.task_id) for i in served.items} == {"completed"}
        back = await layer.trainer_restarted("p", 0)
        again = await layer.next_batch("p", 0, timeout=5)
        return served, back, again

    served, back, again = asyncio.run(go())
    assert back["put_back"] == 8
    assert sorted(i.task_id for i in again.items) == sorted(i.task_id for i in served.items)


def test_a_store_that_is_gone_or_holds_other_rows_is_named(tmp_path):
    layer = _layer(tmp_path)

    async def go():
        await _roll(layer, 8)
        return await layer.next_batch("p", 0, timeout=5)

    served = asyncio.run(go())
    with pytest.raises(RowsUnreadable, match=r"8 of its 8 rows cannot be read from the trajectory store .*nowhere"):
        BatchRows(str(tmp_path / "nowhere")).batch(served)
    # refs that name other rows than the data layer believes (another store behind the same path)
    swapped = tuple(replace(i, ref=j.ref) for i, j in zip(served.items, reversed(served.items)))
    with pytest.raises(RowsUnreadable, match="reads another trajectory store"):
        BatchRows(str(tmp_path / "trajectories")).batch(replace(served, items=swapped))
