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
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Iterable

from astraflow.transport import Link, Packed, PackedDict

#: a lane's sender thread ends after this many idle seconds (started again on the next call)
IDLE_S = 30.0


def _never() -> bool:
    return False


class _Pending:
    """One node's call in a gathered call: ``result(timeout)`` like an actor call's future, and
    ``wait_async(timeout)`` for a node's event loop (``transport.call`` uses it: no thread is
    parked per waiting node, which matters when one process runs many nodes). Cheap to make:
    a lock, and a ``threading.Event`` only once a thread blocks in ``result``."""

    __slots__ = ("_replaced", "_patience_s", "_lock", "_done", "_event", "_wakers", "_value", "_error")

    def __init__(self, replaced: Callable[[], bool] = _never, patience_s: float = 0.0) -> None:
        #: whether the data layer was lost (or re-placed) since the call was made: a deadline
        #: that passes then is waited out, up to ``patience_s`` more (the sender makes the call
        #: again on the new data layer, as ``transport.Link`` does)
        self._replaced, self._patience_s = replaced, patience_s
        self._lock = threading.Lock()
        self._done = False
        self._event: threading.Event | None = None
        #: the futures of the event loops awaiting the answer
        self._wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._value: Any = None
        self._error: BaseException | None = None

    def settle(self, value: Any = None, error: BaseException | None = None) -> None:
        _wake(self._settled(value, error))

    def _settled(self, value: Any, error: BaseException | None) -> list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]:
        with self._lock:
            self._value, self._error, self._done = value, error, True
            wakers, self._wakers = self._wakers, []
            if self._event is not None:
                self._event.set()
        return wakers

    async def wait_async(self, timeout: float | None = None) -> Any:
        """The answer, awaited on the running loop (woken from the sender thread)."""
        if not await self._answered_within(timeout):
            if not self._replaced():
                raise TimeoutError(f"no answer from the data layer within {timeout}s")
            if not await self._answered_within(self._patience_s + (timeout or 0.0)):
                raise TimeoutError(f"the data layer was lost and did not answer within "
                                   f"{self._patience_s:.0f}s of its re-placement")
        return self.result(0)

    async def _answered_within(self, timeout: float | None) -> bool:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._done:
                return True
            answered = loop.create_future()
            self._wakers.append((loop, answered))
        timer = None if timeout is None else loop.call_later(timeout, _resolve, [answered], False)
        try:
            return await answered
        finally:
            if timer is not None:
                timer.cancel()

    def done(self) -> bool:
        return self._done

    def result(self, timeout: float | None = None) -> Any:
        with self._lock:
            if not self._done and self._event is None:
                self._event = threading.Event()
            event = self._event
        if event is not None and not event.wait(timeout) and not (
                self._replaced() and event.wait(self._patience_s + (timeout or 0.0))):
            raise TimeoutError(f"no answer from the data layer within {timeout}s")
        if self._error is not None:
            raise self._error
        return self._value


def settle_all(answers: Iterable[tuple[_Pending, Any]]) -> None:
    """Answer the node calls of one gathered call, waking each waiting event loop once."""
    woken: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
    try:
        for pending, value in answers:
            woken += pending._settled(value, None)
    finally:  # those answered before a failure (the rest get the error) are woken all the same
        _wake(woken)


def _wake(woken: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]) -> None:
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = {}
    for loop, answered in woken:
        by_loop.setdefault(loop, []).append(answered)
    for loop, futures in by_loop.items():
        try:
            loop.call_soon_threadsafe(_resolve, futures, True)
        except RuntimeError:  # the node's loop has closed: nobody waits any more
            pass


def _resolve(futures: list[asyncio.Future], answered: bool) -> None:
    for f in futures:
        if not f.done():
            f.set_result(answered)


class _Lane:
    """The calls of one kind: gathered while calls are on their way, sent by sender threads
    (up to ``senders`` at once: a call waiting on the data layer's snapshot write does not hold
    back the next; calls made meanwhile share the write)."""

    def __init__(self, name: str, send: Callable[[list[tuple[tuple, _Pending]]], None], senders: int = 4,
                 pending: Callable[[], _Pending] = _Pending):
        self.name = name
        self._send = send
        self._pending = pending
        self._queue: list[tuple[tuple, _Pending]] = []
        self._cond = threading.Condition()
        self._senders = senders
        self._threads = 0
        self._idle = 0
        #: gathered calls sent, and node calls they carried
        self.calls = 0
        self.carried = 0

    def submit(self, args: tuple) -> _Pending:
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
    """A data-layer handle shared by the nodes of one worker (module docstring)."""

    def __init__(self, handle: Any):
        #: the data layer's handle (a ``transport.Link``: it follows a re-placed data layer)
        self.handle = handle
        self.lanes = {name: _Lane(name, send, pending=self._pending) for name, send in
                      (("heartbeat", self._heartbeats), ("lease", self._leases), ("complete", self._completes))}

    def _pending(self) -> _Pending:
        """A node's share of a gathered call, which waits for a lost data layer's replacement
        as the link's own calls do (``Link.expect_new``)."""
        link = self.handle
        if not isinstance(link, Link):  # a plain actor handle: nothing re-places it
            return _Pending()
        generation = link.current()[1]
        return _Pending(lambda: link.current()[1] != generation or link.known_lost(generation), link.reconnect_s)

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
    def heartbeat(self, node: str, stats: dict[str, Any]) -> _Pending:
        return self.lanes["heartbeat"].submit((node, stats))

    def lease(self, node: str, capacity: int, wait: float = 0.0, versions: dict[str, int] | None = None) -> _Pending:
        return self.lanes["lease"].submit((node, capacity, wait, versions))

    def complete(self, refs: list) -> _Pending:
        return self.lanes["complete"].submit((refs,))

    def _heartbeats(self, items: list[tuple[tuple, _Pending]]) -> None:
        beats = PackedDict((node, stats) for (node, stats), _ in items)
        replies = self.handle.heartbeat_many(beats).result(60.0)
        settle_all((pending, replies[node]) for (node, _), pending in items)

    def _leases(self, items: list[tuple[tuple, _Pending]]) -> None:
        wait = min(args[2] for args, _ in items)
        requests = Packed((node, capacity, versions) for (node, capacity, _, versions), _ in items)
        got = self.handle.lease_many(requests, wait).result(wait + 60.0)
        settle_all((pending, got[node]) for (node, *_), pending in items)

    def _completes(self, items: list[tuple[tuple, _Pending]]) -> None:
        refs = Packed(ref for (node_refs,), _ in items for ref in node_refs)
        new = self.handle.complete(refs).result(120.0)
        settle_all((pending, new) for _, pending in items)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per kind: gathered calls sent and the node calls they carried."""
        return {name: {"calls": lane.calls, "carried": lane.carried} for name, lane in self.lanes.items()}
