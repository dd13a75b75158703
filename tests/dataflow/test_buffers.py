"""Buffers and batch assembly on their own: ingest with group statistics and the group filter,
the buffer cap, staleness drops, the ordering within quotas, replay, served versus consumed."""

from __future__ import annotations

import random
import uuid

from astraflow.contracts import RolloutTask
from astraflow.dataflow import rules as R
from astraflow.dataflow.buffers import Buffers
from astraflow.dataflow.ledger import Ledger
from astraflow.training.rows import BatchRows
from storage.trajectories import open_trajectory_store

from tests.dataflow.helpers import make_trajectory, store_and_ref

KEEP = R.make(R.FILTERS, "keep_all", {})
DZA = R.make(R.FILTERS, "drop_zero_advantage", {})
FIFO = R.make(R.ORDERINGS, "fifo", {})


class Rig:
    """Buffers for one policy ``p``, a ledger and a real in-memory store."""

    def __init__(self, group_size=2, limit=2, max_staleness=1, batch_size=4):
        self.ledger = Ledger()
        self.buffers = Buffers(["p"], batch_size=batch_size, group_size=group_size, limit=limit,
                               max_staleness=max_staleness, ledger=self.ledger, rng=random.Random(0))
        self.url = f"memory://{uuid.uuid4().hex}"
        self.store = open_trajectory_store(self.url, "a")
        self.writer = self.store.writer("n")

    def group(self, rewards, version=0, filt=KEEP, source=""):
        """Open a group, complete every task with ``rewards``, ingest it."""
        grp = self.buffers.open_group(f"p{len(self.buffers.rolling)}", source)
        tasks = [RolloutTask(task_id=t, group_id=grp.group_id, policies=("p",), workflow="w", prompt={})
                 for t in grp.task_ids]
        for t in tasks:
            self.ledger.add(t.task_id)
            self.ledger.complete(t.task_id)
        refs = store_and_ref(self.writer, [make_trajectory(t, r, version=version) for t, r in zip(tasks, rewards)])
        grp.results.update({r.task_id: r for r in refs})
        return grp, self.buffers.ingest(grp, filt)

    def serve(self, version, n, n_replay=0):
        chosen, taken = self.buffers.take("p", {"": n}, FIFO, version)
        return self.buffers.serve("p", version, chosen, n_replay, 0.0, None), taken


def test_ingest_computes_group_stats_and_the_filter_drops():
    rig = Rig()
    grp, first = rig.group([0.0, 1.0])
    assert first == ([0.0, 1.0], [0.0, 1.0]) and not rig.buffers.rolling  # rewards, and success: no episode stats
    (ready,) = rig.buffers.ready["p"]
    assert [(i.group_mean, i.group_std, i.group_size) for i in ready.items] == [(0.5, 0.5, 2)] * 2
    rig.group([1.0, 1.0], filt=DZA)
    assert rig.buffers.counts["p"]["filtered"] == 2 and rig.ledger.dropped_by_reason == {"zero_advantage": 2}


def test_a_group_scored_alike_has_an_advantage_of_exactly_zero():
    rig = Rig(group_size=3)
    rig.group([0.1, 0.1, 0.1])  # np.mean of these is not 0.1: the advantage would be about 1e-11
    (ready,) = rig.buffers.ready["p"]
    assert [i.group_std for i in ready.items] == [0.0] * 3
    assert [(0.1 - i.group_mean) / (i.group_std + 1e-6) for i in ready.items] == [0.0] * 3


def test_the_buffer_is_capped_and_stale_sequences_are_dropped():
    rig = Rig(limit=1)  # cap: 4 groups
    for _ in range(5):
        rig.group([0.0, 1.0])
    assert len(rig.buffers.ready["p"]) == 4 and rig.buffers.counts["p"]["overflow_dropped"] == 2
    assert rig.buffers.drop_stale("p", version=1) == 8  # staleness 1: within the bound
    assert rig.buffers.drop_stale("p", version=2) == 0
    assert rig.buffers.counts["p"]["stale_dropped"] == 8 and rig.ledger.dropped_by_reason["stale"] == 8


def test_a_served_batch_is_consumed_when_its_version_commits_and_replay_reuses_it():
    rig = Rig()
    rig.group([0.0, 1.0])
    rig.group([1.0, 0.0])
    batch, taken = rig.serve(0, 4)
    assert taken == {"": 4} and len(batch) == 4 and batch.metrics["staleness_hist"] == {"0": 4}
    assert {rig.ledger.state_of(i.task_id) for i in batch.items} == {"completed"}
    rig.buffers.commit("p", 1)
    assert {rig.ledger.state_of(i.task_id) for i in batch.items} == {"consumed"}
    rig.group([0.0, 1.0])
    again, _ = rig.serve(1, 2, n_replay=2)
    assert sum(i.replayed for i in again.items) == 2 and rig.buffers.counts["p"]["replayed"] == 0
    # served by reference; the trainer's side reads every row, replayed ones included
    full = BatchRows(rig.url).batch(again)
    assert [i.task_id for i in full.items] == [i.task_id for i in again.items]
    assert [i.sequence.reward for i in full.items] == [i.reward for i in again.items]
    assert [(i.replayed, i.staleness) for i in full.items] == [(False, 1), (False, 1), (True, 1), (True, 1)]
    rig.group([0.0, 1.0])
    rig.serve(1, 2)  # version 1 asks again: its first batch never reached training
    assert rig.ledger.dropped_by_reason["served_not_trained"] == 2
    assert (rig.buffers.counts["p"]["consumed"], rig.buffers.counts["p"]["replayed"]) == (4, 0)
    assert rig.buffers.staleness_hist["p"] == {0: 4}  # what was trained on, and only that


def test_end_run_drops_what_is_buffered_or_served():
    rig = Rig()
    rig.group([0.0, 1.0])
    rig.group([1.0, 0.0])
    rig.serve(0, 2)
    rig.buffers.end_run()
    assert rig.ledger.dropped_by_reason == {"run_ended": 2, "served_not_trained": 2}
    assert not rig.buffers.routed_left and rig.buffers.status()["buffers"] == {"p": 0}


def test_take_follows_the_ordering_within_each_source_quota():
    rig = Rig(max_staleness=5)
    for src, v in (("a", 0), ("b", 1), ("a", 2)):
        rig.group([0.0, 1.0], version=v, source=src)
    assert rig.buffers.groups_ahead(["a", "b"]) == {"a": 2, "b": 1}
    freshest = R.make(R.ORDERINGS, "freshest", {})
    chosen, taken = rig.buffers.take("p", {"a": 2, "b": 0}, freshest, 2)
    assert taken == {"a": 2, "b": 0} and {i.oldest_version for i in chosen} == {2}
    assert rig.buffers.drop_stale_by_source("p", 2, ["a", "b"]) == {"a": 2, "b": 2}


class _FreshOnly(R.RuleBase):
    """A user ordering that leaves the older groups out (an ordering must not)."""

    def order(self, groups, version, max_staleness):
        return [i for i, g in enumerate(groups) if g.oldest_version == version]


def test_an_ordering_that_leaves_groups_out_is_refused_not_a_short_batch():
    import pytest

    rig = Rig(max_staleness=5)
    for v in (0, 1):
        rig.group([0.0, 1.0], version=v)
    with pytest.raises(ValueError, match=r"_FreshOnly.order returned 1 indices for 2 buffered groups.*"
                                         r"dataflow.group_filter or max_staleness"):
        rig.buffers.take("p", {"": 4}, _FreshOnly(R.SeededParams()), 1)
    assert rig.buffers.status()["buffers"] == {"p": 4}  # nothing was taken


def test_a_group_with_one_sequence_is_incomplete():
    rig = Rig(group_size=1)
    rig.group([1.0])
    assert rig.ledger.dropped_by_reason == {"group_incomplete": 1}


def test_a_replay_share_larger_than_the_pool_serves_what_the_pool_holds():
    """The replay share is fixed when a batch is asked for; a resumed trainer's put-back may
    shrink the pool while the call waits: the batch then replays what is left, without failing
    after its new items were taken from the buffer."""
    rig = Rig(group_size=2, limit=4, batch_size=4)
    rig.group([0.0, 1.0])
    first, _ = rig.serve(0, 2)
    rig.buffers.commit("p", 1)
    rig.group([1.0, 0.0])
    batch, _ = rig.serve(1, 2, n_replay=5)  # the pool holds the 2 served before
    assert len(batch.items) == 4 and sum(i.replayed for i in batch.items) == 2
