"""The data layer's rules, driven directly (no Dask) against a real in-memory Zarr store."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest

from astraflow.dataflow.config import DataflowConfig, DropZeroAdvantageRule, UserCurator

from astraflow.workloads.config import EvalConfig, WorkloadConfig
from astraflow.dataflow import rules as R
from astraflow.dataflow.layer import BatchTimeout, DataLayer
from astraflow.dataflow.ledger import TERMINAL
from astraflow.training.rows import BatchRows

from tests.dataflow.helpers import make_trajectory, store_and_ref

MATH = {"digits": 1, "num_test": 10}


def make_layer(tmp_path, policies=("p",), group_size=4, batch_size=8, eval_every=0, **df) -> DataLayer:
    url = f"memory://{uuid.uuid4().hex}"
    return DataLayer(
        dataflow=DataflowConfig(batch_size=batch_size, **df),
        workload=WorkloadConfig(name="math", params=MATH, group_size=group_size,
                                eval=EvalConfig(every=eval_every, num_prompts=3)),
        policies=list(policies),
        store_url=url,
        metrics_path=str(tmp_path / "metrics.jsonl"),
        max_steps=5,
    )


def run(coro):
    return asyncio.run(coro)


class Node:
    """Scripted node: completes leased tasks with given rewards."""

    def __init__(self, layer: DataLayer, name: str = "n0"):
        self.layer, self.name = layer, name
        self.writer = layer.store.writer(name)

    async def roll(self, n: int, reward_of=lambda t: 1.0, version: int = 0):
        tasks = await self.layer.lease(self.name, n)
        trajs = [make_trajectory(t, reward_of(t), version=version, node=self.name) for t in tasks]
        await self.layer.complete(store_and_ref(self.writer, trajs))
        return tasks


def test_lease_complete_batch_and_group_stats(tmp_path):
    layer = make_layer(tmp_path)

    async def go():
        node = Node(layer)
        # rewards 0,1,0,1 within each group: mean 0.5, std 0.5
        await node.roll(8, reward_of=lambda t: float(int(t.task_id.split("/")[1]) % 2))
        batch = BatchRows(layer.store.url).batch(await layer.next_batch("p", 0, timeout=5))
        assert len(batch) == 8
        for item in batch.items:
            assert item.group_mean == pytest.approx(0.5) and item.group_std == pytest.approx(0.5)
            assert item.group_size == 4 and item.staleness == 0
            assert item.advantage == pytest.approx(1.0 if item.sequence.reward else -1.0, abs=1e-4)
            assert item.loss_mask.sum() == 4
        # served is not consumed: the tasks end when the version trained on them is committed
        assert {layer.ledger.state_of(i.task_id) for i in batch.items} == {"completed"}
        await layer.published("p", 1, {"loss": 0.0})
        assert {layer.ledger.state_of(i.task_id) for i in batch.items} == {"consumed"}

    run(go())


def test_a_batch_served_but_never_trained_is_not_consumed(tmp_path):
    """A trainer that stops before it commits the version trained on a batch: those tasks end
    as dropped (``served_not_trained``) at the run's end, not consumed, and each ends once."""
    layer = make_layer(tmp_path)

    async def go():
        node = Node(layer)
        await node.roll(16, reward_of=lambda t: float(int(t.task_id.split("/")[1]) % 2))
        served = await layer.next_batch("p", 0, timeout=5)
        summary = await layer.finish()  # `served` was never committed
        assert {layer.ledger.state_of(i.task_id) for i in served.items} == {"dropped"}
        assert layer.ledger.dropped_by_reason["served_not_trained"] == 8
        assert summary["open"] == 0 and "consumed" not in summary["states"]

    run(go())


def test_a_batch_asked_for_again_is_served_again_not_dropped(tmp_path):
    """A trainer asks again at the same version: its first answer never reached it (lost, or
    past the call's deadline: a trainer paused that long). The first batch is put back and
    served again, not dropped, and consumed once when that version is committed."""
    layer = make_layer(tmp_path)

    async def go():
        node = Node(layer)
        await node.roll(16, reward_of=lambda t: float(int(t.task_id.split("/")[1]) % 2))
        lost = await layer.next_batch("p", 0, timeout=5)
        again = await layer.next_batch("p", 0, timeout=5)  # the same version asks again
        assert sorted(i.task_id for i in again.items) == sorted(i.task_id for i in lost.items)
        assert "served_not_trained" not in layer.ledger.dropped_by_reason
        assert {layer.ledger.state_of(i.task_id) for i in lost.items} == {"completed"}
        await layer.published("p", 1)
        assert {layer.ledger.state_of(i.task_id) for i in again.items} == {"consumed"}
        assert (await layer.state())["counts"]["p"]["consumed"] == 8

    run(go())


def test_group_waits_for_all_members(tmp_path):
    layer = make_layer(tmp_path)

    async def go():
        node = Node(layer)
        await node.roll(3)  # 3 of the first group of 4
        with pytest.raises(BatchTimeout):
            await layer.next_batch("p", 0, timeout=0.3)
        assert (await layer.state())["buffers"]["p"] == 0

    run(go())


def test_expired_lease_requeued_with_next_attempt_and_late_completion_counted_once(tmp_path):
    layer = make_layer(tmp_path, lease_seconds=0.05)

    async def go():
        tasks = await layer.lease("dead", 4)
        time.sleep(0.1)
        again = await layer.lease("alive", 4)
        assert {t.task_id for t in again} == {t.task_id for t in tasks}
        assert all(t.attempt == 1 for t in again)
        assert layer.ledger.events["requeued_lease_expired"] == 4
        # the dead node's late completion wins (first completion), the retry's is a duplicate
        w = layer.store.writer("dead")
        assert await layer.complete(store_and_ref(w, [make_trajectory(t, 1.0) for t in tasks])) == 4
        w2 = layer.store.writer("alive")
        assert await layer.complete(store_and_ref(w2, [make_trajectory(t, 1.0) for t in again])) == 0
        assert layer.ledger.events["duplicate_completions"] == 4

    run(go())


def test_failed_task_fails_after_max_attempts(tmp_path):
    layer = make_layer(tmp_path, max_attempts=2)

    async def go():
        t = (await layer.lease("n", 1))[0]
        await layer.fail(t.task_id, "boom")
        t2 = (await layer.lease("n", 1))[0]
        assert t2.task_id == t.task_id and t2.attempt == 1
        await layer.fail(t.task_id, "boom")
        assert layer.ledger.state_of(t.task_id) == "failed"
        assert "failed:boom (after 2 attempts)" in layer.ledger.failed_by_reason

    run(go())


def test_stale_sequences_dropped_and_counted(tmp_path):
    layer = make_layer(tmp_path, max_staleness=1)

    async def go():
        node = Node(layer)
        await node.roll(8, reward_of=lambda t: float(int(t.task_id[-1]) % 2), version=0)
        for v in (1, 2):
            await layer.published("p", v, {})
        # trainer at v2 asks: sequences from v0 are 2 versions old > max_staleness 1
        with pytest.raises(BatchTimeout):
            await layer.next_batch("p", 2, timeout=0.2)
        st = await layer.state()
        assert st["counts"]["p"]["stale_dropped"] == 8
        assert layer.ledger.dropped_by_reason["stale"] == 8

    run(go())


def test_drop_zero_advantage_refills(tmp_path):
    layer = make_layer(tmp_path, group_filter=DropZeroAdvantageRule(), prefetch_groups=0)

    async def go():
        node = Node(layer)
        await node.roll(8, reward_of=lambda t: 1.0)  # two groups, all equal rewards
        assert layer.ledger.dropped_by_reason["zero_advantage"] == 8
        # the outstanding bound freed up: replacement groups are leasable
        more = await layer.lease("n0", 8)
        assert len(more) == 8

    run(go())


def test_finish_ends_every_task_exactly_once(tmp_path):
    layer = make_layer(tmp_path)

    async def go():
        node = Node(layer)
        await node.roll(6)  # one full group ingested, half of the next completed
        await layer.lease("n1", 2)  # leased, never completed
        summary = await layer.finish()
        assert summary["open"] == 0
        assert all(r.state in TERMINAL for r in layer.ledger.tasks.values())
        assert sum(summary["states"].values()) == summary["tasks"]
        assert layer.ledger.events["created"] == summary["tasks"]

    run(go())


def test_eval_round_reports_accuracy(tmp_path):
    layer = make_layer(tmp_path, eval_every=1)

    async def go():
        await layer.start_eval(0)
        assert layer.evals.rounds[0].leased_at is None
        leased = await layer.lease("n", 100)
        tasks = [t for t in leased if t.kind == "eval"]
        assert leased[:3] == tasks and len(tasks) == 3  # evaluation tasks are leased first
        assert layer.evals.rounds[0].leased_at is not None  # the round's seconds count from here
        assert all(t.min_version == 0 and t.sampling == {"greedy": True} for t in tasks)
        w = layer.store.writer("n")
        rewards = [1.0, 0.0, 1.0]
        await layer.complete(store_and_ref(w, [make_trajectory(t, r) for t, r in zip(tasks, rewards)]))
        assert await layer.eval_done(0)
        res = (await layer.state())["eval"][0]
        assert res["eval_accuracy"] == pytest.approx(2 / 3)
        await layer.close()
        lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert any(x.get("eval_accuracy") == pytest.approx(2 / 3) and x["step"] == 0 for x in lines)

    run(go())


def test_eval_records_are_written_in_version_order(tmp_path):
    """Evaluation rounds overlap and a later one can finish first: its record waits for the
    earlier one, so metrics.jsonl and state()["eval"] list versions in order; a round held back
    at the end of the run is still written."""
    layer = make_layer(tmp_path, eval_every=1)

    async def go():
        # the layer evaluates v0 on its own; then rounds at v2, v3, v5 overlap
        await layer.start_eval(2)
        await layer.start_eval(3)
        await layer.start_eval(5)
        await layer.start_eval(6)
        leased = [t for t in await layer.lease("n", 100) if t.kind == "eval"]
        by_version = {v: [t for t in leased if t.min_version == v] for v in (0, 2, 3, 5, 6)}
        w = layer.store.writer("n")
        await layer.complete(store_and_ref(w, [make_trajectory(t, 0.5) for t in by_version[0]]))
        await layer.complete(store_and_ref(w, [make_trajectory(t, 1.0) for t in by_version[3]]))
        assert [e["step"] for e in (await layer.state())["eval"]] == [0] and not await layer.eval_done(3)
        await layer.complete(store_and_ref(w, [make_trajectory(t, 0.0) for t in by_version[2]]))
        assert [e["step"] for e in (await layer.state())["eval"]] == [0, 2, 3]
        assert await layer.eval_done(3)
        await layer.complete(store_and_ref(w, [make_trajectory(t, 1.0) for t in by_version[5][:-1]]))
        await layer.complete(store_and_ref(w, [make_trajectory(t, 1.0) for t in by_version[6]]))
        assert [e["step"] for e in (await layer.state())["eval"]] == [0, 2, 3]  # v6 waits for v5
        await layer.finish()  # v5 never finishes: v6, measured, is still written
        await layer.close()
        lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [(x["step"], x["eval_accuracy"]) for x in lines if "eval_accuracy" in x] == [(0, 0.5), (2, 0.0), (3, 1.0), (6, 1.0)]

    run(go())


def test_new_curator_registered_in_test_needs_no_other_change(tmp_path):
    @R.CURATORS.register("only_even_prompts_test")
    class OnlyEven(R.AcceptAll):
        def accept(self, prompt_key, payload):
            return int(prompt_key[1:]) % 2 == 0

    layer = make_layer(tmp_path, curator=UserCurator(type="only_even_prompts_test"))

    async def go():
        tasks = await layer.lease("n", 8)
        keys = {layer.buffers.rolling[t.group_id].prompt_key for t in tasks}
        assert keys and all(int(k[1:]) % 2 == 0 for k in keys)

    run(go())


def test_unknown_rule_name_lists_known(tmp_path):
    with pytest.raises(ValueError, match="known: .*drop_zero_advantage"):
        make_layer(tmp_path, group_filter={"type": "nope"})


def test_a_waiting_lease_gets_the_tasks_a_served_batch_makes_room_for(tmp_path):
    """Long poll: with everything rolled out ahead, ``lease(wait=...)`` waits in the data layer
    and returns the new groups' tasks as soon as the trainer's batch is served (one call, no
    polling), and returns empty-handed when its wait runs out."""
    layer = make_layer(tmp_path, prefetch_groups=0)

    async def go():
        node = Node(layer)
        await node.roll(8)  # the one batch allowed ahead: rolled out and buffered
        assert await layer.lease("n0", 8, 0.3) == []  # nothing came within its wait
        waiting = asyncio.create_task(layer.lease("n0", 8, 60.0))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # still waiting in the data layer
        await layer.next_batch("p", 0, timeout=5)
        tasks = await asyncio.wait_for(waiting, 10.0)  # answered with tasks, long before its 60 s
        assert len(tasks) == 8

    run(go())


@pytest.mark.parametrize("covers", [False, True])
def test_the_rollout_ahead_bound_covers_the_leasing_nodes_only_when_asked(tmp_path, covers):
    """Groups ahead of training: one batch plus ``prefetch_groups``, or, with
    ``prefetch_covers_nodes``, at least the task slots of the nodes that lease (over the group
    size), so many nodes do not poll empty leases behind a bound sized for one batch."""
    layer = make_layer(tmp_path, group_size=4, batch_size=8, prefetch_groups=1, prefetch_covers_nodes=covers)

    async def go():
        got = 0
        for _ in range(2):  # the nodes' slots are recounted at most once a second
            for i in range(6):  # six nodes asking for 8 tasks each: 48 slots, 12 groups
                got += len(await layer.lease(f"n{i}", 8))
            await asyncio.sleep(1.1)
        return got

    base = (8 // 4 + 1) * 4  # one batch (2 groups) plus one group, in tasks
    assert run(go()) == (48 if covers else base)


def test_the_data_layer_process_collects_garbage_less_often_but_never_more(tmp_path):
    import gc

    from astraflow.dataflow.layer import GC_THRESHOLDS

    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        make_layer(tmp_path)
        assert gc.get_threshold() == (*GC_THRESHOLDS, 10)
        gc.set_threshold(GC_THRESHOLDS[0] * 4, 5, 7)  # a process tuned higher keeps its own
        make_layer(tmp_path)
        assert gc.get_threshold() == (GC_THRESHOLDS[0] * 4, GC_THRESHOLDS[1], 7)
    finally:
        gc.set_threshold(*before)


def test_a_late_failure_of_an_earlier_attempt_leaves_the_new_lease_alone(tmp_path):
    """Node A's lease expires and the task goes to node B; A's episode then fails and says so:
    B's lease and its completion stand (a report of the attempt B runs still counts)."""
    import time

    layer = make_layer(tmp_path, lease_seconds=0.05, max_attempts=2)

    async def go():
        (first,) = await layer.lease("A", 1)
        time.sleep(0.1)  # A's lease runs out
        (again,) = await layer.lease("B", 1)
        assert again.task_id == first.task_id and again.attempt == first.attempt + 1
        await layer.fail(first.task_id, "EpisodeTimeout", attempt=first.attempt)
        assert layer.leases.held[again.task_id][0] == "B"
        new = await layer.complete(store_and_ref(layer.store.writer("B"), [make_trajectory(again, 1.0, node="B")]))
        assert new == 1 and layer.ledger.state_of(again.task_id) == "completed"
        (third,) = await layer.lease("C", 1)
        await layer.fail(third.task_id, "engine", attempt=third.attempt)  # the attempt it runs: requeued
        assert third.task_id not in layer.leases.held and layer.ledger.state_of(third.task_id) == "pending"

    run(go())


def test_a_node_declared_gone_before_its_first_call_can_still_call(tmp_path):
    """A worker lost while its node was starting: the name is marked gone before the data layer
    has seen it; a call it makes after that is answered, not failed inside the data layer."""
    layer = make_layer(tmp_path)

    async def go():
        assert await layer.node_gone("w7") == 0
        assert (await layer.heartbeat("w7", {}))["draining"] is False
        assert isinstance(await layer.lease("w7", 4), list)

    run(go())


def test_a_replay_ratio_that_replays_no_row_is_refused_naming_the_least_one():
    from astraflow.dataflow.config import DataflowConfig

    with pytest.raises(ValueError, match="at least 0.125"):
        DataflowConfig(batch_size=8, replay_ratio=0.1)
    assert DataflowConfig(batch_size=3, replay_ratio=1 / 3).replay_rows == 1
    # a row trained on is 2 versions old when a trainer that publishes while it fetches may replay it
    with pytest.raises(ValueError, match="max_staleness 0 never replays.*set max_staleness to 2 or more"):
        DataflowConfig(batch_size=8, replay_ratio=0.5, max_staleness=0)


def test_a_batch_held_back_by_the_first_evaluation_round_says_so(tmp_path):
    """Training rows are there but the first held-out round has not finished (its tasks went to
    a node that never answers): the timeout names the round and how to turn evaluation off."""
    layer = make_layer(tmp_path, eval_every=5)

    async def go():
        await layer.lease("eval-node", len(layer.leases.eval_pending))
        await Node(layer).roll(8, reward_of=lambda t: float(int(t.task_id.split("/")[1]) % 2))
        with pytest.raises(BatchTimeout) as err:
            await layer.next_batch("p", 0, timeout=0.3)
        return str(err.value)

    msg = run(go())
    assert "waiting for the first held-out evaluation round" in msg and "workload.eval.every: 0" in msg, msg


