"""The data layer's change log (``astraflow/dataflow/changelog.py``, ``changes.py``): after
every call, the base and log on disk replay to exactly what the live layer holds; a record
holds only what changed; a torn last record, a compaction and a crash in the middle of one
lose nothing that a call was answered on; a forged record is refused."""

from __future__ import annotations

import dataclasses
import os
import pickle
import zlib
from collections import deque

import numpy as np
import pytest

from astraflow.dataflow import changelog, changes, durable
from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.layer import DataLayer
from astraflow.workloads.config import EvalConfig, WorkloadConfig
from tests.dataflow.helpers import make_trajectory, store_and_ref
from tests.dataflow.test_data_layer import Node, run
from tests.dataflow.test_durable import Paths, _alternating


def plain(x):
    """``x`` with its containers in a canonical order (a replay builds dicts in another order)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__name__, plain(vars(x)))
    if isinstance(x, dict):
        return sorted(((repr(k), plain(v)) for k, v in x.items()), key=lambda kv: kv[0])
    if isinstance(x, (set, frozenset)):
        return sorted(repr(v) for v in x)
    if isinstance(x, (list, tuple, deque)):
        return [plain(v) for v in x]
    if isinstance(x, np.ndarray):
        return ("ndarray", str(x.dtype), x.tolist())
    return x


def saved(paths) -> dict:
    state = durable.load(paths.snapshot)
    state.pop("saved_at")
    return state


def live(layer) -> dict:
    state = changes.state_of(layer, layer.durability.fingerprint, layer.durability.lengths())
    state.pop("saved_at")
    # what is derived from the task records is what the rooms hold
    assert state["leases"]["held"] == {t: n for t, (n, _) in layer.leases.held.items()}
    assert set(state["leases"]["pending"]) == set(layer.leases.pending)
    assert set(state["leases"]["eval_pending"]) == set(layer.leases.eval_pending)
    # the items each task has not yet settled: counted from the buffers and served batches
    assert state["buffers"]["routed_left"] == layer.buffers.routed_left
    return state


def same(paths, layer) -> None:
    assert plain(saved(paths)) == plain(live(layer))


def log_files(paths) -> list:
    return [changelog.log_path(paths.snapshot, n) for n in changelog.log_numbers(paths.snapshot)]


async def _every_kind_of_call(layer, paths, check) -> None:
    """Calls that change every part of the state, ``check`` after each (after a commit: a call
    that moved no task, such as a heartbeat, leaves its changes to the next one)."""
    node = Node(layer)

    async def committed():
        await layer.durability.commit()
        check_now()

    check_now, check = check, committed
    await node.roll(16, reward_of=_alternating)
    await check()
    held = await layer.lease("n1", 4)
    await check()
    await layer.fail(held[0].task_id, "engine")
    await layer.heartbeat("n1", {"holding": [t.task_id for t in held[1:]]})
    await layer.drain("n2")
    await check()
    await layer.next_batch("p", 0, timeout=5)
    await check()
    await layer.published("p", 1, {"loss": 0.0})
    await check()
    assert await layer.node_gone("n1") == 3
    await check()
    await node.roll(8, reward_of=lambda t: 1.0)  # equal rewards: settled by the group filter or buffered
    await check()
    await layer.next_batch("p", 1, timeout=5)
    await layer.trainer_restarted("p", 1)  # the batch just served goes back
    await check()
    await layer.start_eval(2)  # a round open at a check: written, it leaves only its record
    await check()
    evals = await layer.lease("n3", len(layer.leases.eval_pending))
    trajs = [make_trajectory(t, 1.0, node="n3") for t in evals if t.kind == "eval"]
    await layer.complete(store_and_ref(node.writer, trajs))
    await check()
    await layer.finish()
    await check()


def test_after_every_call_the_saved_state_is_the_live_state(tmp_path):
    paths = Paths(tmp_path)
    layer = paths.layer(eval_every=2)
    run(_every_kind_of_call(layer, paths, lambda: same(paths, layer)))
    run(layer.close())


def test_entries_are_pickled_to_the_bytes_pickle_dumps_writes(tmp_path):
    """The change log pickles a record's entries with one pickler and a dispatch table for the
    data layer's record classes: each entry's bytes are still exactly ``pickle.dumps``'s."""
    paths = Paths(tmp_path)
    layer = paths.layer(eval_every=2)
    kinds = set()

    def check():
        found = [(kind, changes.entry(layer, kind, key)) for kind, key in changes.all_keys(layer)]
        values = [value for _, value in found if value is not None]
        kinds.update(kind for kind, value in found if value is not None)
        assert changelog._dumps_each(values) == [pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL) for v in values]

    run(_every_kind_of_call(layer, paths, check))
    run(layer.close())
    assert {"task", "group", "node", "ready", "serving", "round", "result"} <= kinds, kinds


def test_entries_after_a_big_one_are_still_pickle_dumps_bytes():
    """After an entry that grew the pickler's memo (a served batch's items), the next ones are
    pickled by a fresh pickler: the same bytes as ``pickle.dumps`` still."""
    big = [changes.group_of(f"g{i}/0") + "/x" * (i % 7) for i in range(3000)] + [("t", i) for i in range(500)]
    values = [{"a": 1}, big, ("task", {"k": [1, 2]}), big[:10], 3.5]
    assert changelog._dumps_each(values) == [pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL) for v in values]


def test_a_record_holds_what_changed_not_what_is_outstanding(tmp_path):
    paths = Paths(tmp_path)
    layer = DataLayer(
        dataflow=DataflowConfig(batch_size=8, prefetch_groups=60),
        workload=WorkloadConfig(name="math", params={"digits": 2, "num_test": 10}, group_size=4),
        policies=["p"], store_url=paths.url, metrics_path=str(paths.metrics), max_steps=5,
        snapshot_path=str(paths.snapshot), journal_path=str(paths.journal))

    async def go():
        for i in range(50):  # 200 tasks leased and outstanding
            await layer.lease(f"n{i}", 4)
        records_before, _ = changelog.read_records(log_files(paths)[-1])
        await layer.lease("late", 1)
        records, _ = changelog.read_records(log_files(paths)[-1])
        assert len(layer.leases.held) == 201 and len(records) == len(records_before) + 1
        # the task leased, the tasks of a group created for it and their group, the node
        written = [kind for kind, _, _ in pickle.loads(records[-1])["set"]]
        assert len(written) <= 2 + 2 * layer.wcfg.group_size, written
        same(paths, layer)
        await layer.close()

    run(go())


def test_a_lease_or_a_completion_writes_its_tasks_not_their_group(tmp_path):
    """A lease or a completion moves only the task's own record (a completion's result is
    written with it): the group is written when a task is created or ends, or it is ingested."""
    paths = Paths(tmp_path)
    layer = paths.layer()

    async def go():
        first = await layer.lease("n1", 1)
        group = first[0].group_id
        await layer.lease("n2", 1)  # the group's second task: no group created for it
        records, _ = changelog.read_records(log_files(paths)[-1])
        written = {(kind, key) for kind, key, _ in pickle.loads(records[-1])["set"]}
        assert ("group", group) not in written and any(kind == "task" for kind, _ in written), written
        node = Node(layer)
        await layer.complete(store_and_ref(node.writer, [make_trajectory(first[0], 1.0, node="n1")]))
        records, _ = changelog.read_records(log_files(paths)[-1])
        written = {(kind, key): blob for kind, key, blob in pickle.loads(records[-1])["set"]}
        assert ("group", group) not in written, written
        _, record, result = pickle.loads(written["task", first[0].task_id])
        assert record.state == "completed" and result.task_id == first[0].task_id
        same(paths, layer)  # restored, the group holds the result again
        await layer.close()

    run(go())


def test_a_torn_last_record_restores_the_state_before_it(tmp_path):
    paths = Paths(tmp_path)
    layer = paths.layer()

    async def go():
        await Node(layer).roll(8, reward_of=_alternating)
        before = plain(saved(paths))
        torn = await layer.lease("n1", 4)
        await layer.close()
        return before, torn

    before, torn = run(go())
    last = log_files(paths)[-1]
    size = last.stat().st_size
    os.truncate(last, size - 5)  # the process died in the middle of the last append
    assert plain(saved(paths)) == before
    with open(last, "ab") as f:  # or garbage after it
        f.write(b"\x00" * 7)
    assert plain(saved(paths)) == before
    # the next layer continues from there: the tasks of the torn lease are waiting again
    again = paths.layer(keep_leases=True)
    assert not again.leases.held and {t.task_id for t in torn} <= set(again.leases.pending)
    run(again.close())


def test_a_damaged_record_with_whole_records_after_it_is_refused_not_cut_short(tmp_path):
    """One flipped byte in an early record: the whole records after it would be dropped with it
    (and the metrics and ledger cut back to match), so the state is refused, naming the file."""
    paths = Paths(tmp_path)
    layer = paths.layer()
    run(Node(layer).roll(8, reward_of=_alternating))
    run(layer.close())
    last = log_files(paths)[-1]
    records, torn = changelog.read_records(last)
    assert len(records) >= 2 and not torn
    data = bytearray(last.read_bytes())
    first = changelog.HEADER.size + 10  # inside the first record's payload
    data[first] ^= 0xFF
    last.write_bytes(bytes(data))
    with pytest.raises(changelog.UnusableSnapshot, match=r"record at byte 0 is damaged and whole records follow"):
        saved(paths)


def test_compaction_writes_a_new_base_and_a_crash_in_the_middle_of_it_loses_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(changelog, "COMPACT_MIN_BYTES", 1)  # compact whenever the log outgrows the base
    paths = Paths(tmp_path)
    layer = paths.layer(eval_every=2)
    real_write = changelog.write_atomically
    interrupted = []

    def dies_before_the_rename(path, data, sync):
        # the files as a crash leaves them between starting a new log and renaming the new
        # base over the old one: the old base, its log, and the new log
        interrupted.append(len(changelog.log_numbers(path)))
        raise OSError("the process died here")

    def check():
        same(paths, layer)
        if len(interrupted) == 2:
            monkeypatch.setattr(changelog, "write_atomically", real_write)

    async def go():  # one event loop: a compaction under way is not cancelled at its end
        await _every_kind_of_call(layer, paths, check)
        await layer.close()  # waits for a compaction under way

    monkeypatch.setattr(changelog, "write_atomically", dies_before_the_rename)
    run(go())
    assert interrupted[:2] == [2, 3]  # each interrupted compaction left the older logs in place
    # a compaction that ran removed them
    assert layer.durability.log.stats()["compactions"] >= 1 and len(log_files(paths)) == 1


def test_a_restored_layer_writes_a_new_base_and_drops_the_old_logs(tmp_path):
    paths = Paths(tmp_path)
    layer = paths.layer()

    async def go():
        await Node(layer).roll(8, reward_of=_alternating)
        await layer.lease("n1", 4)
        await layer.close()

    run(go())
    old = changelog.log_numbers(paths.snapshot)
    again = paths.layer(keep_leases=True)
    assert changelog.log_numbers(paths.snapshot) == [old[-1] + 1]
    assert changelog.read_records(log_files(paths)[-1]) == ([], False)  # everything is in the base
    same(paths, again)
    run(again.close())


def test_a_forged_record_is_refused_without_running_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths = Paths(tmp_path)
    layer = paths.layer()
    run(layer.close())

    class Boom:
        def __reduce__(self):
            return (os.system, ("touch pwned",))

    blob = pickle.dumps(Boom())
    payload = pickle.dumps({"seq": 1, "small": pickle.dumps({}), "set": [("task", "x", blob)]})
    with open(log_files(paths)[-1], "ab") as f:
        f.write(changelog.HEADER.pack(len(payload), zlib.crc32(payload)) + payload)
    with pytest.raises(durable.UnusableSnapshot, match="posix.system|os.system"):
        durable.load(paths.snapshot)
    assert not (tmp_path / "pwned").exists()


def test_prompt_orders_across_epochs_replay_exactly(tmp_path):
    paths = Paths(tmp_path)
    layer = DataLayer(
        dataflow=DataflowConfig(batch_size=8),
        workload=WorkloadConfig(name="math", params={"digits": 1, "num_test": 10, "num_train": 3}, group_size=4,
                                eval=EvalConfig(every=0)),
        policies=["p"], store_url=paths.url, metrics_path=str(paths.metrics), max_steps=50,
        snapshot_path=str(paths.snapshot), journal_path=str(paths.journal))

    async def go():
        node = Node(layer)
        for v in range(6):  # 12 groups of 3 prompts: four epochs
            await node.roll(8, reward_of=_alternating, version=v)
            await layer.next_batch("p", v, timeout=5)  # replay sampling draws from the random stream too
            await layer.published("p", v + 1, {"loss": 0.0})
            same(paths, layer)
        assert layer.mixer.epoch[""] >= 4
        await layer.close()

    run(go())


def test_a_task_one_policy_consumed_while_another_holds_it_is_restored(tmp_path):
    """Two policies: the solver's trainer consumes a batch while the verifier's buffer still
    holds the same tasks. Only then is a task's route written (consumed, not yet ended), and a
    restore gives each task its items not settled back, counted from the buffers."""
    from astraflow.contracts import Provenance, Sequence, Trajectory

    def two_policy_trajectory(task, solver_reward: float, verifier_reward: float) -> Trajectory:
        """A solver turn, then a sequence with tokens of both policies."""
        s0 = Sequence.build(tokens=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], logprobs=[0, 0, -1, -1],
                            policy_ids=[-1, -1, 0, 0], versions=[-1, -1, 0, 0], reward=solver_reward)
        s1 = Sequence.build(tokens=[5, 6, 7, 8], loss_mask=[0, 1, 0, 1], logprobs=[0, -1, 0, -1],
                            policy_ids=[-1, 0, -1, 1], versions=[-1, 0, -1, 0], reward=verifier_reward)
        return Trajectory(task.task_id, task.group_id, task.policies, task.workflow, task.kind, task.attempt,
                          (s0, s1), Provenance(node="n"))

    paths = Paths(tmp_path)

    def layer2() -> DataLayer:
        return DataLayer(
            dataflow=DataflowConfig(batch_size=4, prefetch_groups=0),
            workload=WorkloadConfig(name="math", workflow="solver_verifier", params={"digits": 1},
                                    group_size=2, eval=EvalConfig(every=0)),
            policies=["solver", "verifier"], store_url=paths.url, metrics_path=str(paths.metrics),
            max_steps=10, snapshot_path=str(paths.snapshot), journal_path=str(paths.journal))

    layer = layer2()

    async def go():
        writer = layer.store.writer("n")
        for _ in range(4):
            tasks = await layer.lease("n", 8)
            trajs = [two_policy_trajectory(t, float(i % 2), float((i + 1) % 2)) for i, t in enumerate(tasks)]
            await layer.complete(store_and_ref(writer, trajs))
        await layer.next_batch("solver", 0, timeout=5)
        await layer.published("solver", 1, {"loss": 0.0})
        partial = {t for t in layer.buffers.task_consumed if layer.buffers.routed_left.get(t)}
        assert partial, "no task consumed by the solver and still held for the verifier"
        assert {k for k, _ in changes.all_keys(layer) if k == "route"} == {"route"}
        same(paths, layer)
        await layer.close()

    run(go())
    restored = layer2()
    assert restored.buffers.routed_left == layer.buffers.routed_left
    assert restored.buffers.task_consumed == layer.buffers.task_consumed
    run(restored.close())


def test_a_base_of_the_previous_format_is_restored(tmp_path):
    """A base written in the previous format (task entries without results, groups holding
    theirs, routes counting the items not settled) restores to the same state."""
    paths = Paths(tmp_path)
    layer = paths.layer()

    async def go():
        node = Node(layer)
        await node.roll(8, reward_of=_alternating)
        held = await layer.lease("n1", 4)  # part of a group completes: its results so far are in the group
        await layer.complete(store_and_ref(node.writer, [make_trajectory(held[0], 1.0, node="n1")]))
        await layer.close()

    run(go())
    want = live(layer)
    state = changes.state_of(layer, layer.durability.fingerprint, layer.durability.lengths())
    old_entries = {kind: {} for kind in changes.KINDS}
    for kind, key in changes.all_keys(layer):
        value = changes.entry(layer, kind, key)
        if value is not None:
            old_entries[kind][key] = value[:2] if kind == "task" else value
    for tid, left in layer.buffers.routed_left.items():
        old_entries["route"][tid] = (left, tid in layer.buffers.task_consumed, layer.buffers.task_drop_reason.get(tid))
    assert any(g.results for g in layer.buffers.rolling.values())
    base = {"format": 2, "fingerprint": layer.durability.fingerprint, "seq": 0, "log": 1,
            "small": changelog._dumps(changes.small(layer, layer.durability.lengths())),
            "entries": {kind: {key: changelog._dumps(v) for key, v in found.items()}
                        for kind, found in old_entries.items()}}
    for n in changelog.log_numbers(paths.snapshot):
        changelog.log_path(paths.snapshot, n).unlink()
    paths.snapshot.write_bytes(changelog._dumps(base))
    restored = saved(paths)
    assert state["format"] == 3 and restored["format"] == 3
    assert plain({**restored, "format": None}) == plain({**want, "format": None})
