"""One data-layer call per tick for all the RaaS nodes of a worker (``RaaSNodeGroup``).

Every actor call has a fixed cost on the data layer's worker, whatever it carries; with many
nodes per worker their heartbeats alone would keep it busy. ``Coalescer`` stands in for the
data-layer handle of each node of a group: ``heartbeat``, ``lease`` and ``complete`` calls made
while earlier calls of the same kind are on their way are gathered and sent as one call
(``heartbeat_many``, ``lease_many``, one ``complete`` with every node's references); each
node gets its own answer. A call made while a sender of its kind is free goes at once, so a
lone node waits no longer than before. Every other method goes straight to the handle.

A lease long poll holds a sender while the data layer has no task for any node of the group:
the nodes asking meanwhile go with the other sender.
``complete`` answers each node with the count of new completions of the whole call.

With ``rollout.lease_ahead``, the nodes' leases are answered by the worker's ``LeaseStock``
(its refills are the worker's only lease calls); the stock's own heartbeat goes with the
nodes' gathered ones.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from astraflow.rollout.lease_stock import LeaseStock
from astraflow.pending import Pending, settle_all
from astraflow.transport import Link, Packed, PackedDict

#: a gatherer's sender thread ends after this many idle seconds (started again on the next call)
IDLE_S = 30.0


class _Gatherer:
    """The calls of one kind: gathered while calls are on their way, sent by sender threads
    (up to ``senders`` at once: a call waiting on the data layer's snapshot write does not hold
    back the next; calls made meanwhile share the write)."""

    def __init__(self, name: str, send: Callable[[list[tuple[tuple, Pending]]], None], senders: int = 4,
                 pending: Callable[[], Pending] = Pending):
        self.name = name
        self._send = send
        self._pending = pending
        self._queue: list[tuple[tuple, Pending]] = []
        self._cond = threading.Condition()
        self._senders = senders
        self._threads = 0
        self._idle = 0
        #: gathered calls sent, and node calls they carried
        self.calls = 0
        self.carried = 0

    def submit(self, args: tuple) -> Pending:
        pending = self._pending()
        with self._cond:
            self._queue.append((args, pending))
            if self._idle == 0 and self._threads < self._senders:
                self._threads += 1
                threading.Thread(target=self._run, name=f"coalesce-{self.name}", daemon=True).start()
            self._cond.notify()
        return pending

    def _run(self) -> None:
        while True:
            with self._cond:
                self._idle += 1
                got = self._cond.wait_for(lambda: self._queue, timeout=IDLE_S)
                self._idle -= 1
                if not got:
                    self._threads -= 1
                    return
                items, self._queue = self._queue, []
                self.calls += 1
                self.carried += len(items)
            try:
                self._send(items)
            except BaseException as err:  # every node of the call gets the error (e.g. the actor is lost)
                for _, pending in items:
                    if not pending.done():
                        pending.settle(error=err)


class Coalescer:
    """A data-layer handle shared by the nodes of one worker (module docstring). With
    ``lease_ahead`` > 0 and the ``worker``'s name, leases are served from a ``LeaseStock``
    first."""

    def __init__(self, handle: Any, worker: str = "", lease_ahead: int = 0, lease_wait_s: float = 0.5):
        #: the data layer's handle (a ``transport.Link``: it follows a re-placed data layer)
        self.handle = handle
        self.gatherers = {name: _Gatherer(name, send, pending=self._pending) for name, send in
                      (("heartbeat", self._heartbeats), ("lease", self._leases), ("complete", self._completes))}
        self.stock = LeaseStock(handle, worker, lease_ahead, lease_wait_s) if lease_ahead > 0 and worker else None

    def _pending(self) -> Pending:
        """A node's share of a gathered call, which waits for a lost data layer's replacement
        as the link's own calls do (``Link.expect_new``)."""
        link = self.handle
        if not isinstance(link, Link):  # a plain actor handle: nothing re-places it
            return Pending()
        generation = link.current()[1]
        return Pending(lambda: link.current()[1] != generation or link.known_lost(generation), link.reconnect_s)

    # ``bind`` reads and sets ``_worker``: it is the handle's
    @property
    def _worker(self) -> Any:
        return getattr(self.handle, "_worker", None)

    @_worker.setter
    def _worker(self, worker: Any) -> None:
        self.handle._worker = worker

    def set(self, handle: Any) -> None:
        self.handle.set(handle)

    def expect_new(self) -> None:
        self.handle.expect_new()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.handle, name)

    # -- the gathered calls ----------------------------------------------------------------
    def heartbeat(self, node: str, stats: dict[str, Any]) -> Pending:
        if self.stock is not None:
            self.stock.saw(node, stats.get("versions"))
        return self.gatherers["heartbeat"].submit((node, stats))

    def lease(self, node: str, capacity: int, wait: float = 0.0, versions: dict[str, int] | None = None) -> Pending:
        if self.stock is not None and capacity > 0:
            answer = self.stock.lease(node, capacity, wait, versions)
            if answer is not None:
                return answer
        return self.gatherers["lease"].submit((node, capacity, wait, versions))

    def complete(self, refs: list) -> Pending:
        return self.gatherers["complete"].submit((refs,))

    def _heartbeats(self, items: list[tuple[tuple, Pending]]) -> None:
        stock = self.stock
        beats = PackedDict()
        own = stock.beat() if stock is not None else None
        if own is not None:  # first: it restores the stock's flag that the nodes' moves need
            beats[stock.name] = own
        for (node, stats), _ in items:  # with a stock, the stock reports the nodes' versions
            beats[node] = stats if own is None else {**stats, "stocked": True}
        replies = self.handle.heartbeat_many(beats).result(60.0)
        if own is not None:
            stock.answered(replies[stock.name])  # type: ignore[union-attr]
        settle_all((pending, replies[node]) for (node, _), pending in items)

    def _leases(self, items: list[tuple[tuple, Pending]]) -> None:
        wait = min(args[2] for args, _ in items)
        requests = Packed((node, capacity, versions) for (node, capacity, _, versions), _ in items)
        got = self.handle.lease_many(requests, wait).result(wait + 60.0)
        settle_all((pending, got[node]) for (node, *_), pending in items)

    def _completes(self, items: list[tuple[tuple, Pending]]) -> None:
        refs = Packed(ref for (node_refs,), _ in items for ref in node_refs)
        new = self.handle.complete(refs).result(120.0)
        settle_all((pending, new) for _, pending in items)

    def drain(self) -> None:
        """The worker drains: the lease stock stops and returns what no node took."""
        if self.stock is not None:
            self.stock.drain()

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per kind: gathered calls sent and the node calls they carried; the lease stock's counts."""
        out: dict[str, dict[str, Any]] = {name: {"calls": gatherer.calls, "carried": gatherer.carried}
                                          for name, gatherer in self.gatherers.items()}
        if self.stock is not None:
            out["stock"] = self.stock.stats()
        return out
