"""Leases and the ledger hand-off: which node holds which task, until when.

The RaaS-facing side of a task's life: waiting in a queue (evaluation tasks first), leased to a
node with a deadline, completed, or handed back. Every transition is recorded in the ``Ledger``
(``ledger.py``). This room knows nothing of groups, buffers or batches: a task that ends as
failed goes to the ``on_failed`` callback, which settles its group or evaluation round.

Named asynchronous overlap, *lease expiry*: a task leased by a node that neither completes it
nor renews it (``renew``, on the node's heartbeat, for the tasks the node says it holds) within
``lease_seconds`` returns to the
front of its queue with ``attempt + 1``, or ends as failed after ``max_attempts``. A late
completion of an earlier attempt is still accepted if the task has not ended (the first
completion wins); later ones are counted as duplicates. Every task ends exactly once.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Any, Callable, Container

from astraflow.contracts import RolloutTask, TrajectoryRef
from astraflow.dataflow.ledger import TERMINAL, Ledger


class Leases:
    """Task queues, leases and nodes of the data layer."""

    def __init__(self, lease_seconds: float, max_attempts: int, on_failed: Callable[[RolloutTask], None]):
        self.lease_seconds = lease_seconds
        self.max_attempts = max_attempts
        self._on_failed = on_failed
        self.ledger = Ledger()
        #: tasks not ended yet, by id (a completed task leaves: its trajectories are the record)
        self.tasks: dict[str, RolloutTask] = {}
        self.pending: deque[str] = deque()
        self.eval_pending: deque[str] = deque()
        #: task -> (node, deadline)
        self.held: dict[str, tuple[str, float]] = {}
        #: node -> what it reports on heartbeats plus ``leased`` / ``completed`` / ``draining``
        self.nodes: dict[str, dict[str, Any]] = {}

    def _queue(self, kind: str) -> deque[str]:
        return self.eval_pending if kind == "eval" else self.pending

    def node(self, name: str) -> dict[str, Any]:
        return self.nodes.setdefault(name, {"leased": 0, "completed": 0, "draining": False})

    def add(self, task: RolloutTask) -> None:
        """A new task, queued at the back of its queue."""
        self.tasks[task.task_id] = task
        self.ledger.add(task.task_id)
        self._queue(task.kind).append(task.task_id)

    def waiting(self) -> bool:
        """Whether any task waits to be leased."""
        return bool(self.eval_pending or self.pending)

    def take(self, node: str, capacity: int) -> list[RolloutTask]:
        """Lease up to ``capacity`` waiting tasks to ``node`` (evaluation tasks first)."""
        out: list[RolloutTask] = []
        deadline = time.time() + self.lease_seconds
        for queue in (self.eval_pending, self.pending):
            while queue and len(out) < capacity:
                tid = queue.popleft()
                task = replace(self.tasks[tid], lease_deadline=deadline)
                self.tasks[tid] = task
                self.ledger.lease(tid, node)
                self.held[tid] = (node, deadline)
                out.append(task)
        self.node(node)["leased"] += len(out)
        return out

    def complete(self, ref: TrajectoryRef) -> RolloutTask | None:
        """Record a completion; the completed task, or None for a duplicate or an ended task."""
        lease = self.held.get(ref.task_id)
        if not self.ledger.tasks.get(ref.task_id) or not self.ledger.complete(ref.task_id):
            return None
        if lease is not None:
            del self.held[ref.task_id]
        else:  # a late completion of an expired attempt that was requeued but not re-leased
            q = self._queue(ref.kind)
            if ref.task_id in q:
                q.remove(ref.task_id)
        self.node(ref.node)["completed"] += 1
        return self.tasks.pop(ref.task_id)

    def expire(self) -> None:
        """Hand back every lease past its deadline."""
        now = time.time()
        for tid, (_, deadline) in list(self.held.items()):
            if deadline < now:
                self.give_back(tid, "lease_expired")

    def renew(self, node: str, holding: Container[str] | None = None) -> None:
        """Extend the leases of ``node`` by ``lease_seconds`` from now: those in ``holding`` (the
        tasks the node says it still works on), or all of them when it does not say. A lease the
        node no longer knows of (its episode ended without a completion or a failure reaching
        here) is not renewed, so it expires instead of being held for ever."""
        deadline = time.time() + self.lease_seconds
        for tid, (n, _) in list(self.held.items()):
            if n == node and (holding is None or tid in holding):
                self.held[tid] = (n, deadline)

    def give_back(self, tid: str, why: str) -> None:
        """A leased task comes back (expired, failed, node gone): requeue or fail it."""
        del self.held[tid]
        task = self.tasks[tid]
        self.ledger.requeue(tid, why)
        if task.attempt + 1 >= self.max_attempts:
            self.ledger.end(tid, "failed", f"{why}_after_{self.max_attempts}_attempts")
            self._on_failed(self.tasks.pop(tid))
            return
        self.tasks[tid] = replace(task, attempt=task.attempt + 1, lease_deadline=None)
        self._queue(task.kind).appendleft(tid)

    def on_worker(self, node: str) -> list[str]:
        """``node`` and the nodes that share its worker (heartbeat ``worker``: several nodes per
        worker, ``rollout.nodes_per_worker``)."""
        return [node] + [n for n, info in self.nodes.items() if info.get("worker") == node and n != node]

    def node_gone(self, node: str) -> int:
        """The node's worker is gone (with every node on it): their leases are handed back
        now. Returns how many."""
        names = set(self.on_worker(node))
        tids = [t for t, (n, _) in self.held.items() if n in names]
        for tid in tids:
            self.give_back(tid, "node_gone")
        for name in names:
            self.nodes.setdefault(name, {})["gone"] = True
        return len(tids)

    def end_all(self, keep: Container[str]) -> None:
        """End of the run: every task that has not ended, except those in ``keep``, is
        dropped as ``run_ended`` (a leased or waiting one is also counted as abandoned)."""
        for tid, rec in list(self.ledger.live.items()):
            if rec.state in TERMINAL or tid in keep:
                continue
            self.held.pop(tid, None)
            self.tasks.pop(tid, None)
            if rec.state != "completed":
                self.ledger.events["abandoned_" + rec.state] += 1
            self.ledger.end(tid, "dropped", "run_ended")
        self.pending.clear()
        self.eval_pending.clear()
