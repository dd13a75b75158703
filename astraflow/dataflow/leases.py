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

A *lease stock* (``rollout.lease_ahead``) is a worker's entry among the nodes, flagged
``stock``: it leases tasks ahead for the nodes of its worker, which take them without a call
here; when a node's heartbeat names a task the stock holds among those the node holds (or the
node completes it), the lease ``move``s to the node. What the stock never handed out it
returns (``unlease``: no attempt counted).

The cost of a call does not grow with what is outstanding: leases wait for expiry in a
deadline heap (a renewal updates ``held`` only; a popped entry whose lease was renewed is
pushed again with its new deadline, one whose lease ended is dropped, and the heap is rebuilt
from the live leases when ended ones' entries outnumber them), and each node's leases
are a set of their own, so a heartbeat renews one node's leases without looking at the others.
"""

from __future__ import annotations

import heapq
import itertools
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
        #: task -> (node, deadline); change it with ``hold`` / ``_release`` only (they keep the
        #: per-node sets and the deadline heap in step)
        self.held: dict[str, tuple[str, float]] = {}
        #: node -> the tasks it holds
        self.by_node: dict[str, set[str]] = {}
        #: (deadline, entry number, task): a lease's entry is the one whose number ``_entry`` holds
        self._heap: list[tuple[float, int, str]] = []
        self._entry: dict[str, int] = {}
        self._numbers = itertools.count()
        #: node -> what it reports on heartbeats plus ``leased`` / ``completed`` / ``draining``
        self.nodes: dict[str, dict[str, Any]] = {}
        #: nodes whose ``leased`` / ``completed`` / ``draining`` / ``gone`` changed since the data
        #: layer's change log last took them (None: not kept; ``changes.py``)
        self.changed_nodes: set[str] | None = None

    def touch_node(self, name: str) -> None:
        """What the change log keeps of ``name`` changed."""
        if self.changed_nodes is not None:
            self.changed_nodes.add(name)

    def _queue(self, kind: str) -> deque[str]:
        return self.eval_pending if kind == "eval" else self.pending

    def node(self, name: str) -> dict[str, Any]:
        info = self.nodes.get(name)
        if info is None:
            info = self.nodes[name] = {"leased": 0, "completed": 0, "draining": False}
            self.touch_node(name)
        return info

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
                task = self.tasks[tid]
                self.ledger.lease(tid, node)
                self.hold(tid, node, deadline)
                out.append(task)
        info = self.node(node)
        if out:  # a call that leased nothing changes nothing the change log keeps
            info["leased"] += len(out)
            self.touch_node(node)
        return out

    def hold(self, tid: str, node: str, deadline: float) -> None:
        """``node`` holds ``tid`` until ``deadline`` (a new lease, or one restored)."""
        old = self.held.get(tid)
        if old is not None and old[0] != node:
            self._release(tid)
        self.held[tid] = (node, deadline)
        self.by_node.setdefault(node, set()).add(tid)
        self._push(tid, deadline)

    def _push(self, tid: str, deadline: float) -> None:
        number = next(self._numbers)
        self._entry[tid] = number
        heapq.heappush(self._heap, (deadline, number, tid))

    def _release(self, tid: str) -> None:
        """The lease of ``tid`` ends (its heap entry is dropped when it comes up)."""
        node, _ = self.held.pop(tid)
        self._entry.pop(tid, None)
        mine = self.by_node.get(node)
        if mine is not None:
            mine.discard(tid)
            if not mine:
                del self.by_node[node]

    def complete(self, ref: TrajectoryRef) -> RolloutTask | None:
        """Record a completion; the completed task, or None for a duplicate or an ended task."""
        lease = self.held.get(ref.task_id)
        if ref.task_id not in self.ledger.live or not self.ledger.complete(ref.task_id):
            return None
        if lease is not None and lease[0] != ref.node:  # done before its node's heartbeat told of the move
            self.move(ref.task_id, ref.node)
        if lease is not None:
            self._release(ref.task_id)
        else:  # a late completion of an expired attempt that was requeued but not re-leased
            q = self._queue(ref.kind)
            if ref.task_id in q:
                q.remove(ref.task_id)
        self.node(ref.node)["completed"] += 1
        self.touch_node(ref.node)
        return self.tasks.pop(ref.task_id)

    def expire(self) -> None:
        """Hand back every lease past its deadline (the heap's entries due by now only)."""
        now = time.time()
        if len(self._heap) > 2 * len(self.held) + 1024:  # mostly ended leases' entries: rebuilt
            self._heap = []
            for tid, (_, deadline) in self.held.items():
                self._push(tid, deadline)
        heap = self._heap
        while heap and heap[0][0] < now:
            _, number, tid = heapq.heappop(heap)
            if self._entry.get(tid) != number:
                continue  # the lease ended (or was re-leased) since this entry was pushed
            deadline = self.held[tid][1]
            if deadline < now:
                self.give_back(tid, "lease_expired")
            else:  # renewed since: comes up again at its new deadline
                self._push(tid, deadline)

    def renew(self, node: str, holding: Container[str] | None = None) -> None:
        """Extend the leases of ``node`` by ``lease_seconds`` from now: those in ``holding`` (the
        tasks the node says it still works on), or all of them when it does not say. A lease the
        node no longer knows of (its episode ended without a completion or a failure reaching
        here) is not renewed, so it expires instead of being held for ever. A task named in
        ``holding`` that its worker's lease stock holds has been taken by the node: it moves."""
        deadline = time.time() + self.lease_seconds
        mine = self.by_node.get(node, ())
        if holding is None:
            for tid in mine:
                self.held[tid] = (node, deadline)
            return
        for tid in holding:
            if tid in mine or (tid in self.held and self.move(tid, node)):
                self.held[tid] = (node, deadline)

    def is_stock(self, name: str) -> bool:
        """Whether ``name`` is a worker's lease stock (``lease_ahead``), not a node."""
        return bool(self.nodes.get(name, {}).get("stock"))

    def move(self, tid: str, node: str) -> bool:
        """A task leased to a worker's stock was handed to ``node`` of that worker: the lease
        is the node's from now on (same deadline). A task the stock no longer holds (its lease
        expired and went elsewhere, or it ended) is left alone. Returns whether it moved."""
        lease = self.held.get(tid)
        if lease is None or lease[0] == node or not self.is_stock(lease[0]):
            return False
        stock = lease[0]
        if self.nodes[stock].get("worker") != self.nodes.get(node, {}).get("worker", self.nodes[stock].get("worker")):
            return False  # another worker's stock: not this node's to take
        self.hold(tid, node, lease[1])
        self.ledger.moved(tid, node)
        self.node(stock)["leased"] -= 1
        self.node(node)["leased"] += 1
        self.touch_node(stock)
        self.touch_node(node)
        return True

    def unlease(self, tid: str) -> None:
        """A leased task that never ran returns to the front of its queue, its attempt not
        counted (a lease stock gives back what its nodes did not take)."""
        self._release(tid)
        self.ledger.returned(tid)
        self._queue(self.tasks[tid].kind).appendleft(tid)

    def give_back(self, tid: str, why: str) -> None:
        """A leased task comes back (expired, failed, node gone): requeue or fail it."""
        self._release(tid)
        task = self.tasks[tid]
        self.ledger.requeue(tid, why)
        if task.attempt + 1 >= self.max_attempts:
            self.ledger.end(tid, "failed", f"{why} (after {self.max_attempts} attempts)")
            self._on_failed(self.tasks.pop(tid))
            return
        self.tasks[tid] = replace(task, attempt=task.attempt + 1)
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
            self.node(name)["gone"] = True  # a name not seen yet gets a whole entry: it may still call
            self.touch_node(name)
        return len(tids)

    def end_all(self, keep: Container[str]) -> None:
        """End of the run: every task that has not ended, except those in ``keep``, is
        dropped as ``run_ended`` (a leased or waiting one is also counted as abandoned)."""
        for tid, rec in list(self.ledger.live.items()):
            if rec.state in TERMINAL or tid in keep:
                continue
            if tid in self.held:
                self._release(tid)
            self.tasks.pop(tid, None)
            if rec.state != "completed":
                self.ledger.events["abandoned_" + rec.state] += 1
            self.ledger.end(tid, "dropped", "run_ended")
        self.pending.clear()
        self.eval_pending.clear()
