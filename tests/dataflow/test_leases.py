"""Leases and the ledger hand-off on their own: queues, lease expiry and attempts, first
completion wins, node loss, the end of the run."""

from __future__ import annotations

import time

from astraflow.contracts import RolloutTask, TrajectoryRef
from astraflow.dataflow.leases import Leases


def task(tid: str, kind: str = "train") -> RolloutTask:
    return RolloutTask(task_id=tid, group_id=tid.split("/")[0], policies=("p",), workflow="math_single",
                       prompt={}, kind=kind)


def ref(t: RolloutTask, node: str = "n") -> TrajectoryRef:
    return TrajectoryRef(t.task_id, t.group_id, t.kind, t.attempt, node, ())


def make(max_attempts: int = 3):
    failed: list[RolloutTask] = []
    return Leases(30.0, max_attempts, failed.append), failed


def expire_now(leases: Leases, tid: str) -> None:
    """Move a lease's deadline into the past (instead of waiting for it)."""
    node, _ = leases.held[tid]
    leases.hold(tid, node, 0.0)


def test_take_leases_evaluation_first_with_a_deadline():
    leases, _ = make()
    for t in (task("g1/0"), task("g1/1"), task("e/0", "eval")):
        leases.add(t)
    got = leases.take("n", 2)
    assert [t.task_id for t in got] == ["e/0", "g1/0"]
    assert leases.ledger.state_of("g1/0") == "leased" and leases.nodes["n"]["leased"] == 2
    assert leases.waiting() and list(leases.pending) == ["g1/1"]
    assert all(leases.held[t.task_id][1] > time.time() for t in got)


def test_expired_lease_goes_back_to_the_front_then_fails_after_max_attempts():
    leases, failed = make(max_attempts=2)
    leases.add(task("g/0"))
    leases.add(task("g/1"))
    t = leases.take("n", 1)[0]
    expire_now(leases, t.task_id)
    leases.expire()
    assert list(leases.pending) == ["g/0", "g/1"] and leases.tasks["g/0"].attempt == 1
    assert leases.ledger.events["requeued_lease_expired"] == 1 and not failed
    leases.take("n", 1)
    expire_now(leases, "g/0")
    leases.expire()
    assert [f.task_id for f in failed] == ["g/0"] and "g/0" not in leases.tasks
    assert leases.ledger.failed_by_reason == {"lease_expired (after 2 attempts)": 1}


def test_renew_keeps_a_lease_and_the_first_completion_wins():
    leases, _ = make()
    leases.add(task("g/0"))
    t = leases.take("dead", 1)[0]
    expire_now(leases, t.task_id)
    leases.renew("dead")
    leases.expire()
    assert "g/0" in leases.held
    expire_now(leases, t.task_id)
    leases.expire()  # requeued, not leased again: the late completion is accepted
    assert leases.complete(ref(t, "dead")) is not None and not leases.pending
    assert leases.complete(ref(t, "other")) is None
    assert leases.ledger.events["duplicate_completions"] == 1 and leases.nodes["dead"]["completed"] == 1


def test_node_gone_hands_back_its_leases_and_end_all_drops_the_rest():
    leases, _ = make()
    for i in range(4):
        leases.add(task(f"g/{i}"))
    leases.take("a", 2)
    leases.take("b", 1)
    assert leases.node_gone("a") == 2 and leases.nodes["a"]["gone"]
    done = leases.take("b", 1)[0]
    leases.complete(ref(done))
    leases.end_all(keep={done.task_id})
    assert leases.ledger.state_of(done.task_id) == "completed"  # kept: its buffer ends it
    assert leases.ledger.dropped_by_reason["run_ended"] == 3
    assert leases.ledger.events["abandoned_leased"] == 1 and leases.ledger.events["abandoned_pending"] == 2
    assert not leases.waiting() and not leases.held


def test_a_heartbeat_renews_only_the_tasks_the_node_still_holds():
    """A task the node lost track of (its episode ended without a completion or a failure that
    reached the data layer) is left out of the heartbeat: its lease expires and is requeued,
    instead of being renewed for ever."""
    leases, _ = make()
    for i in range(2):
        leases.add(task(f"g/{i}"))
    held, lost = leases.take("n", 2)
    for t in (held, lost):
        expire_now(leases, t.task_id)
    leases.renew("n", holding={held.task_id})
    leases.expire()
    assert list(leases.held) == [held.task_id] and list(leases.pending) == [lost.task_id]
    assert leases.ledger.events["requeued_lease_expired"] == 1
