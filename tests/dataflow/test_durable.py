"""The data layer's durable state (``astraflow/dataflow/durable.py``): a layer built on the
snapshot and journal of a lost one continues exactly where the lost one last answered, with
nothing lost and nothing trained twice; a resumed run's leases go back to the queue; a forged
snapshot is refused without running anything."""

from __future__ import annotations

import json
import os
import pickle
import time
import uuid
from collections import Counter

import pytest

from astraflow.dataflow import durable
from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.layer import DataLayer
from astraflow.workloads.config import EvalConfig, WorkloadConfig
from tests.dataflow.test_data_layer import MATH, Node, run
from tests.dataflow.helpers import make_trajectory, store_and_ref


def _alternating(t) -> float:
    return float(int(t.task_id.split("/")[1]) % 2)


class Paths:
    def __init__(self, tmp_path):
        self.url = f"memory://{uuid.uuid4().hex}"
        self.metrics = tmp_path / "metrics.jsonl"
        self.snapshot = tmp_path / "dataflow.snapshot"
        self.journal = tmp_path / "ledger.jsonl"
        self.state = tmp_path / "dataflow_state.json"

    def layer(self, keep_leases=False, group_size=4, eval_every=0, max_steps=5) -> DataLayer:
        return DataLayer(
            dataflow=DataflowConfig(batch_size=8),
            workload=WorkloadConfig(name="math", params=MATH, group_size=group_size,
                                    eval=EvalConfig(every=eval_every, num_prompts=3)),
            policies=["p"], store_url=self.url, metrics_path=str(self.metrics), max_steps=max_steps,
            state_path=str(self.state), snapshot_path=str(self.snapshot), journal_path=str(self.journal),
            keep_leases=keep_leases,
        )

    def journal_lines(self) -> list[dict]:
        return [json.loads(x) for x in self.journal.read_text().splitlines()]

    def steps(self) -> list[int]:
        return [json.loads(x)["step"] for x in self.metrics.read_text().splitlines() if '"step"' in x]


def _ended_once(lines: list[dict]) -> Counter:
    """Every created task ends exactly once; returns the outcomes."""
    created = Counter(x["t"] for x in lines if x["e"] == "created")
    ended = Counter(x["t"] for x in lines if x["e"] != "created")
    assert set(created.values()) == {1} and set(ended.values()) == {1}, (created, ended)
    assert set(created) == set(ended)
    return Counter(x["e"] for x in lines if x["e"] != "created")


def test_a_replaced_layer_continues_where_the_lost_one_answered(tmp_path):
    paths = Paths(tmp_path)
    lost = paths.layer()
    node = Node(lost)

    async def before():
        await node.roll(16, reward_of=_alternating)
        first = await lost.next_batch("p", 0, timeout=5)
        await lost.published("p", 1, {"loss": 0.0})
        held = await lost.lease("n0", 4)  # the node still works on these when the layer dies
        in_hand = await lost.next_batch("p", 1, timeout=5)  # the trainer may or may not have it
        await lost.close()
        return first, held, in_hand

    first, held, in_hand = run(before())
    live = {t: r.state for t, r in lost.ledger.live.items()}
    restored_at = time.time()
    layer = paths.layer(keep_leases=True)
    # silent while no data layer answered, not by its fault: its silence counts from now, as its leases' time
    assert layer.leases.nodes["n0"]["last_seen"] >= restored_at
    assert layer.restored["leases_kept"] == 4 and layer.restored["served_uncommitted"] == {"p": [1]}
    assert layer.versions == {"p": 1} and {t: r.state for t, r in layer.ledger.live.items()} == live
    assert set(layer.leases.held) == {t.task_id for t in held}
    assert layer.counts["p"]["consumed"] == 8  # the batch in hand is not trained on yet

    async def after():
        node.layer = layer
        again = await layer.next_batch("p", 1, timeout=5)  # asked again: put back, served again
        assert sorted(i.task_id for i in again.items) == sorted(i.task_id for i in in_hand.items)
        await layer.published("p", 2, {"loss": 0.0})
        trajs = [make_trajectory(t, _alternating(t)) for t in held]
        assert await layer.complete(store_and_ref(node.writer, trajs)) == 4  # the node reports to the new one
        await layer.finish()
        await layer.close()

    run(after())
    outcomes = _ended_once(paths.journal_lines())
    assert outcomes["consumed"] == 16 and "served_not_trained" not in paths.journal.read_text()
    assert paths.steps() == [1, 2]
    consumed = {x["t"] for x in paths.journal_lines() if x["e"] == "consumed"}
    assert consumed == {i.task_id for i in first.items} | {i.task_id for i in in_hand.items}


def test_a_version_reported_again_changes_nothing(tmp_path):
    paths = Paths(tmp_path)
    layer = paths.layer()

    async def go():
        await Node(layer).roll(8, reward_of=_alternating)
        await layer.next_batch("p", 0, timeout=5)
        await layer.published("p", 1, {"loss": 0.0})
        await layer.published("p", 1, {"loss": 0.0})  # a retried call
        await layer.close()

    run(go())
    assert paths.steps() == [1]


def _one_step(paths: Paths) -> None:
    """A layer that served one batch, saw its version published and closed."""
    layer = paths.layer()

    async def go():
        await Node(layer).roll(8, reward_of=_alternating)
        await layer.next_batch("p", 0, timeout=5)
        await layer.published("p", 1, {"loss": 0.0})
        await layer.close()

    run(go())


def test_lines_written_after_the_last_snapshot_are_cut_back(tmp_path):
    paths = Paths(tmp_path)
    _one_step(paths)
    good_metrics, good_journal = paths.metrics.read_text(), paths.journal.read_text()
    with open(paths.metrics, "a") as f:  # a step line and ends the dead layer wrote, unsaved
        f.write(json.dumps({"step": 2, "policy": "p"}) + "\n")
    with open(paths.journal, "a") as f:
        f.write(json.dumps({"t": "g0000001/0", "e": "consumed"}) + "\n")
    paths.layer(keep_leases=True).metrics.close()
    assert paths.metrics.read_text() == good_metrics and paths.journal.read_text() == good_journal


def test_a_journal_cut_short_in_a_line_is_cut_back_to_its_last_whole_line(tmp_path):
    """``ledger.jsonl`` shorter than the saved state records, its last line torn (a power loss,
    a damaged file): the torn line is cut, so the lines the resumed run appends stay whole
    (appended to it, the next one would have been unreadable too)."""
    paths = Paths(tmp_path)
    _one_step(paths)
    whole = paths.journal.read_bytes()
    with open(paths.journal, "r+b") as f:
        f.truncate(len(whole) - 7)
    layer = paths.layer(keep_leases=True)
    layer.durability.journal("late/0", "created", None)  # a line the resumed run appends
    run(layer.close())
    lines = paths.journal.read_text().splitlines()
    assert [json.loads(x) for x in lines]  # every line parses
    assert json.loads(lines[-1]) == {"t": "late/0", "e": "created"}
    assert paths.journal.read_bytes().startswith(whole[: whole.rstrip(b"\n").rfind(b"\n") + 1])


def test_a_resumed_run_requeues_the_old_leases_and_puts_back_uncommitted_batches(tmp_path):
    paths = Paths(tmp_path)
    old = paths.layer()

    async def before():
        node = Node(old)
        await node.roll(8, reward_of=_alternating)
        served = await old.next_batch("p", 0, timeout=5)  # the run dies before v1 is committed
        held = await old.lease("n0", 4)
        await old.close()
        return served, held

    served, held = run(before())
    layer = paths.layer(keep_leases=False)
    assert not layer.leases.held and layer.restored["leases_released"] == 4
    assert all(layer.leases.tasks[t.task_id].attempt == 0 for t in held)  # not the task's fault
    assert set(layer.leases.pending) >= {t.task_id for t in held}

    async def after():
        out = await layer.trainer_restarted("p", 0, restart=False)  # the resumed trainer starts at v0
        assert out == {"put_back": 8, "recovered": []} and not layer.trainer_restarts["p"]
        again = await layer.next_batch("p", 0, timeout=5)
        assert sorted(i.task_id for i in again.items) == sorted(i.task_id for i in served.items)
        await layer.published("p", 1, {"loss": 0.0})
        await layer.finish()
        await layer.close()

    run(after())
    assert _ended_once(paths.journal_lines())["consumed"] == 8


def test_a_changed_config_ends_the_saved_tasks_instead_of_restoring_them(tmp_path):
    paths = Paths(tmp_path)
    old = paths.layer()

    async def before():
        await old.lease("n0", 4)
        await old.close()

    run(before())
    layer = paths.layer(group_size=2)
    assert layer.restored is None and not layer.leases.held
    run(layer.close())
    lines = paths.journal_lines()
    assert {x["r"] for x in lines if x["e"] != "created"} == {"config_changed"}
    created = {x["t"] for x in lines if x["e"] == "created"}
    assert created and created <= {x["t"] for x in lines if x["e"] == "dropped"}


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_a_forged_snapshot_is_refused_without_running_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "dataflow.snapshot"
    path.write_bytes(pickle.dumps({"format": durable.FORMAT, "x": _Boom()}))
    with pytest.raises(durable.UnusableSnapshot, match="posix.system|os.system"):
        durable.load(path)
    assert not (tmp_path / "pwned").exists()
    path.write_bytes(b"\x80\x05not a pickle")
    with pytest.raises(durable.UnusableSnapshot, match="cannot be read"):
        durable.load(path)


def test_a_resumed_run_forgets_the_old_nodes_a_new_one_may_reuse_a_name(tmp_path):
    paths = Paths(tmp_path)
    old = paths.layer()

    async def before():
        await old.lease("n0", 4)
        await old.drain("n0")  # a clean stop drains every node
        await old.close()

    run(before())
    layer = paths.layer(keep_leases=False)
    assert len(run(layer.lease("n0", 4))) == 4  # the new incarnation's n0 is not draining


class _FullDisk:
    """A file whose writes fail from the ``after``-th on, as on a disk that filled up."""

    def __init__(self, file, after: int):
        self.file, self.after, self.writes = file, after, 0

    def write(self, text):
        self.writes += 1
        if self.writes >= self.after:
            raise OSError(28, "No space left on device")
        return self.file.write(text)

    def __getattr__(self, name):
        return getattr(self.file, name)


def test_a_call_stopped_half_way_by_a_full_disk_is_never_committed(tmp_path):
    """The ledger fills the disk in the middle of ``published``: the version is recorded in
    memory, part of the batch settled. No later commit may make that state durable (its retry
    is refused too); the re-placed layer starts from the last whole state, and the trainer's
    retry then settles the whole batch once."""
    paths = Paths(tmp_path)
    lost = paths.layer()

    async def before():
        await Node(lost).roll(16, reward_of=_alternating)
        batch = await lost.next_batch("p", 0, timeout=5)
        journal = lost.durability.journal
        journal._file = _FullDisk(journal._file, after=3)
        with pytest.raises(OSError, match="No space left"):
            await lost.published("p", 1, {"loss": 0.0})
        journal._file = journal._file.file  # space freed: still, nothing of that call is committed
        with pytest.raises(OSError, match="No space left"):
            await lost.published("p", 1, {"loss": 0.0})
        return batch

    batch = run(before())
    assert lost.versions == {"p": 1}  # in memory only
    layer = paths.layer(keep_leases=True)
    assert layer.versions == {"p": 0} and layer.restored["served_uncommitted"] == {"p": [0]}

    async def after():
        await layer.published("p", 1, {"loss": 0.0})  # the trainer's retry, to the new layer
        await layer.finish()
        await layer.close()

    run(after())
    outcomes = _ended_once(paths.journal_lines())
    consumed = {x["t"] for x in paths.journal_lines() if x["e"] == "consumed"}
    assert consumed == {i.task_id for i in batch.items} and outcomes["consumed"] == 8
    assert paths.steps() == [1]


def test_a_trainer_resumed_behind_the_layer_trains_the_later_versions_again(tmp_path):
    """A damaged newest version moved aside: the trainer resumes from the one before, and the
    batch it trains for the version after is settled as consumed, not left served."""
    paths = Paths(tmp_path)
    first = paths.layer()

    async def step(layer, node, v):
        await node.roll(8, reward_of=_alternating)
        batch = await layer.next_batch("p", v, timeout=5)
        await layer.published("p", v + 1, {"loss": 0.0})
        return batch

    async def before():
        node = Node(first)
        await step(first, node, 0)
        await step(first, node, 1)
        await first.close()

    run(before())
    resumed = paths.layer()
    assert resumed.versions == {"p": 2}

    async def after():
        await resumed.trainer_restarted("p", 1, restart=False)  # weights/p/v2 moved aside
        assert resumed.versions == {"p": 1}
        again = await step(resumed, Node(resumed, "n1"), 1)
        await resumed.finish()
        await resumed.close()
        return again

    again = run(after())
    ends = {x["t"]: x["e"] for x in paths.journal_lines() if x["e"] != "created"}
    assert {ends[i.task_id] for i in again.items} == {"consumed"}
    assert paths.steps() == [1, 2, 2]


def test_a_resumed_run_counts_run_time_not_the_time_between_runs(tmp_path):
    """A new incarnation's elapsed time (its rates' denominator, its lines' ``time``) goes on
    from where the last one saved; a data layer re-placed within a run keeps its start."""
    paths = Paths(tmp_path)
    first = paths.layer()
    node = Node(first)

    async def before():
        await node.roll(8, reward_of=_alternating)
        await first.next_batch("p", 0, timeout=5)
        await first.published("p", 1, {"loss": 0.0})
        await first.close()

    run(before())
    ran = time.time() - first._started
    time.sleep(1.5)
    resumed = paths.layer()
    assert time.time() - resumed._started < ran + 1.0
    replaced = paths.layer(keep_leases=True)
    assert replaced._started == resumed._started  # the start the resumed layer saved
    run(resumed.close())
    run(replaced.close())


def _move_snapshot_aside(paths) -> None:
    """What the damaged-snapshot message advises: the snapshot and its change log out of the way."""
    from astraflow.dataflow import changelog

    paths.snapshot.unlink()
    for n in changelog.log_numbers(paths.snapshot):
        changelog.log_path(paths.snapshot, n).unlink()


def test_a_resume_without_the_snapshot_ends_the_tasks_the_journal_left_open(tmp_path):
    """The snapshot and its log moved aside (what the damaged-snapshot message advises): the
    resume starts from dataflow_state.json, and every task the journal created and never ended
    ends there, as dropped (snapshot_lost), so each task still ends exactly once."""
    paths = Paths(tmp_path)
    layer = paths.layer()

    async def go():
        await Node(layer).roll(8, reward_of=_alternating)
        await layer.lease("n1", 4)  # in flight when the run dies
        await layer.close()

    run(go())
    _move_snapshot_aside(paths)
    again = paths.layer()
    run(again.close())
    lines = paths.journal_lines()
    created = {x["t"] for x in lines if x["e"] == "created"}
    ended = Counter(x["t"] for x in lines if x["e"] != "created")
    assert created == set(ended) and set(ended.values()) == {1}
    assert any(x.get("r") == "snapshot_lost" for x in lines)


@pytest.mark.parametrize("steps", [0, 1])
def test_a_resume_without_the_snapshot_makes_new_groups_under_new_ids(tmp_path, steps):
    """``dataflow_state.json`` counts the groups as of the last step (none before the first):
    groups made since are in the journal, and the resumed layer's groups must not reuse their ids."""
    paths = Paths(tmp_path)
    layer = paths.layer()

    async def go():
        await Node(layer).roll(8, reward_of=_alternating)
        for v in range(steps):
            await layer.next_batch("p", v, timeout=5)
            await layer.published("p", v + 1, {})
        await layer.lease("n1", 8)  # groups made after the last step
        await layer.close()

    run(go())
    _move_snapshot_aside(paths)
    again = paths.layer()
    assert again.versions == {"p": steps}
    assert len(run(again.lease("n2", 4))) == 4
    run(again.close())
    created = Counter(x["t"] for x in paths.journal_lines() if x["e"] == "created")
    assert set(created.values()) == {1}




def test_a_journal_shorter_than_the_saved_state_is_warned_about(tmp_path, caplog):
    paths = Paths(tmp_path)
    _one_step(paths)
    os.truncate(paths.journal, paths.journal.stat().st_size // 2)
    with caplog.at_level("WARNING", logger="astraflow.dataflow"):
        paths.layer(keep_leases=True).metrics.close()
    said = [r.getMessage() for r in caplog.records if "fewer than" in r.getMessage()]
    assert len(said) == 1 and str(paths.journal) in said[0] and "its last records are lost" in said[0]
