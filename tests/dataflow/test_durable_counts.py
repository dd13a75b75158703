"""What a data layer keeps of the run so far when it is re-placed or a run resumes: the per-node
staleness of consumed sequences (the per-partition ``consumed``), and, on a resume whose config
changed what the saved tasks mean, the ledger's counters, the finished evaluations and the
consumption counts, while the old open tasks end as dropped (``config_changed``), counted."""

from __future__ import annotations

import json
import logging
import pickle
from collections import Counter
from types import SimpleNamespace

import pytest

from astraflow.dataflow import changelog, changes
from astraflow.runtime.monitoring.partition_stats import partition_counts
from tests.dataflow.test_data_layer import Node, run
from tests.dataflow.test_durable import Paths, _alternating, _ended_once


async def _two_nodes_consumed(layer, n0: Node | None = None) -> None:
    """Sequences of n0 consumed at staleness 0, of n1 at staleness 1 (trained one version later)."""
    await (n0 or Node(layer, "n0")).roll(8, reward_of=_alternating)
    await Node(layer, "n1").roll(8, reward_of=_alternating)
    await layer.next_batch("p", 0, timeout=5)
    await layer.published("p", 1, {"loss": 0.0})
    await layer.next_batch("p", 1, timeout=5)
    await layer.published("p", 2, {"loss": 0.0})


@pytest.mark.parametrize("keep_leases", [True, False], ids=["re-placed", "resumed"])
def test_the_staleness_per_node_survives_a_replacement_and_a_resume(tmp_path, keep_leases):
    paths = Paths(tmp_path)
    lost = paths.layer()
    run(_two_nodes_consumed(lost))
    want = {n: Counter(h) for n, h in lost.buffers.staleness_by_node.items()}
    assert want == {"n0": Counter({0: 8}), "n1": Counter({1: 8})}
    run(lost.close())
    layer = paths.layer(keep_leases=keep_leases)
    assert layer.buffers.staleness_by_node == want
    assert run(layer.state())["consumed_staleness_by_node"] == {"n0": {"0": 8}, "n1": {"1": 8}}
    run(layer.close())


def test_a_node_of_an_earlier_incarnation_counts_in_its_partition():
    """A resumed run keeps the consumption of nodes its fleet never had: their partition is in
    their worker's name."""
    fleet = SimpleNamespace(workers={})
    dl = {"nodes": {}, "consumed_staleness_by_node": {"rollout-r-local-cpu-0": {"1": 4},
                                                      "rollout-h-eu-H100-3.n1": {"0": 2}, "odd": {"0": 9}}}
    counts = partition_counts(dl, fleet, ["r", "h"])
    assert counts["r"]["staleness"] == Counter({1: 4}) and counts["h"]["staleness"] == Counter({0: 2})
    assert set(counts) == {"r", "h"}  # a name that is no worker's is left out


def test_a_commit_writes_the_staleness_of_the_nodes_it_consumed_only(tmp_path):
    paths = Paths(tmp_path)
    layer = paths.layer()

    async def go():
        await _two_nodes_consumed(layer)
        last = changelog.log_path(paths.snapshot, changelog.log_numbers(paths.snapshot)[-1])
        records, _ = changelog.read_records(last)
        written = [(kind, key) for kind, key, _ in pickle.loads(records[-1])["set"] if kind == "staleness"]
        assert written == [("staleness", "n1")]
        assert "staleness_by_node" not in pickle.loads(pickle.loads(records[-1])["small"])["buffers"]
        await layer.close()

    run(go())


def test_a_snapshot_written_before_the_staleness_was_saved_still_restores(tmp_path):
    """A base of the same format without the ``staleness`` entries (an earlier AstraFlow's)."""
    paths = Paths(tmp_path)
    old = paths.layer()
    run(_two_nodes_consumed(old))
    run(old.close())
    lengths = {"metrics": paths.metrics.stat().st_size, "journal": paths.journal.stat().st_size}
    entries: dict[str, dict] = {kind: {} for kind in changes.KINDS if kind != "staleness"}
    for kind, key in changes.all_keys(old):
        value = changes.entry(old, kind, key) if kind in entries else None
        if value is not None:
            entries[kind][key] = changelog._dumps(value)
    base = {"format": 3, "fingerprint": old.durability.fingerprint, "seq": 0, "log": 1,
            "small": changelog._dumps(changes.small(old, lengths)), "entries": entries}
    for n in changelog.log_numbers(paths.snapshot):
        changelog.log_path(paths.snapshot, n).unlink()
    paths.snapshot.write_bytes(changelog._dumps(base))
    layer = paths.layer()
    assert layer.versions == {"p": 2} and layer.buffers.staleness_by_node == {}
    assert layer.ledger.summary() == old.ledger.summary()
    run(layer.close())


class Changed:
    """A run with two evaluations, consumed batches, a batch served and never committed and open
    tasks, resumed with another group size (another fingerprint)."""

    def __init__(self, tmp_path, caplog):
        self.paths = paths = Paths(tmp_path)
        old = paths.layer(eval_every=2)

        async def before():
            node = Node(old)
            await node.roll(3)  # the first evaluation round (v0)
            await _two_nodes_consumed(old, node)  # v2: its round is started
            await node.roll(3)  # v2's round completes
            await node.roll(8, reward_of=_alternating)
            await old.next_batch("p", 2, timeout=5)  # served, never committed
            await old.lease("n0", 4)  # open tasks of the old config
            await old.close()

        run(before())
        assert [r["step"] for r in old.evals.results] == [0, 2] and old.buffers.serving["p"]
        self.old = old
        self.ledger, self.open_tasks = old.ledger.summary(), len(old.ledger.live)
        with caplog.at_level(logging.WARNING, logger="astraflow.dataflow"):
            self.layer = paths.layer(eval_every=2, group_size=2)
        self.said = [r.getMessage() for r in caplog.records if "config_changed" in r.getMessage()]

    def finish(self) -> dict:
        """Run on a little, end the run: the ledger's summary."""
        async def after():
            await Node(self.layer).roll(4, reward_of=_alternating)
            summary = await self.layer.finish()
            await self.layer.close()
            return summary

        return run(after())


def test_a_changed_config_drops_the_open_tasks_and_says_how_many(tmp_path, caplog):
    c = Changed(tmp_path, caplog)
    assert c.open_tasks and c.layer.restored is None and not c.layer.ledger.live  # not reused
    assert len(c.said) == 1 and f"{c.open_tasks} open tasks" in c.said[0], c.said


def test_a_changed_config_carries_the_ledgers_counters_over(tmp_path, caplog):
    c = Changed(tmp_path, caplog)
    now, before = c.layer.ledger.summary(), c.ledger
    assert now["dropped_by_reason"] == {**before["dropped_by_reason"], "config_changed": c.open_tasks}
    assert now["events"] == {**before["events"], "dropped": before["events"].get("dropped", 0) + c.open_tasks}
    assert now["tasks"] == before["tasks"] and now["open"] == 0
    assert sum(now["states"].values()) == before["tasks"]
    end = c.finish()  # the summary tells what the journal holds, across both incarnations
    assert end["states"] == dict(_ended_once(c.paths.journal_lines()))
    assert end["dropped_by_reason"]["config_changed"] == c.open_tasks


def test_a_changed_config_does_not_evaluate_a_version_again(tmp_path, caplog):
    c = Changed(tmp_path, caplog)
    run(c.layer.resume_evaluation())  # at v2, evaluated before the resume
    assert [r["step"] for r in c.layer.evals.results] == [0, 2] and not c.layer.leases.eval_pending
    c.finish()
    evals = [line["step"] for line in map(json.loads, c.paths.metrics.read_text().splitlines())
             if "eval_accuracy" in line]
    assert evals == [0, 2]


def test_a_changed_config_keeps_what_was_consumed_and_admits_new_groups(tmp_path, caplog):
    c = Changed(tmp_path, caplog)
    assert c.layer.buffers.staleness_by_node == c.old.buffers.staleness_by_node
    assert c.layer.generated.sequences == c.old.generated.sequences
    # admission's estimate of a group's yield (accepted / groups ingested) starts afresh with the new groups
    assert c.layer.buffers.counts["p"]["accepted"] == 0 and c.layer.buffers.groups_ingested == 0

    async def batch():
        await Node(c.layer).roll(16, reward_of=_alternating)
        return await c.layer.next_batch("p", 2, timeout=5)

    assert len(run(batch()).items) == 8
    run(c.layer.close())
