"""``Pending``: an answer awaited like an actor call's future, from a thread or from an event
loop: one node's share of a gathered data-layer call (``Coalescer``) or of a lease stock's
refill (``LeaseStock``), or a call on the direct lane (``lane.py``)."""

from __future__ import annotations

import asyncio
import math
import threading
import weakref
from typing import Any, Callable, Iterable

#: a deadline at least this far off shares a timer with the others due in the same tick
COARSE_AFTER_S = 2.0
#: the tick of shared deadlines: such a deadline passes up to this much late
TICK_S = 0.25


def _never() -> bool:
    return False


class Pending:
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

    def _settled(self, value: Any,
                 error: BaseException | None) -> list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]:
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
        if timeout is not None and timeout >= COARSE_AFTER_S:
            ticks = _deadlines(loop)
            tick = ticks.add(answered, timeout)
            try:
                return await answered
            finally:
                ticks.discard(tick, answered)
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


def settle_all(answers: Iterable[tuple[Pending, Any]]) -> None:
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


class _Deadlines:
    """The long deadlines of the answers awaited on one event loop, by tick: one timer per tick
    that has any, not one per call. A process of many nodes makes thousands of calls a second,
    nearly all answered long before their deadline; a timer each kept the loop's timer heap
    large and busy with cancelled entries."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.due: dict[int, set[asyncio.Future]] = {}

    def add(self, answered: asyncio.Future, timeout: float) -> int:
        tick = math.ceil((self.loop.time() + timeout) / TICK_S)
        waiting = self.due.get(tick)
        if waiting is None:
            waiting = self.due[tick] = set()
            self.loop.call_at(tick * TICK_S, self._passed, tick)
        waiting.add(answered)
        return tick

    def discard(self, tick: int, answered: asyncio.Future) -> None:
        waiting = self.due.get(tick)
        if waiting is not None:
            waiting.discard(answered)

    def _passed(self, tick: int) -> None:
        _resolve(list(self.due.pop(tick, ())), False)


_LOOP_DEADLINES: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Deadlines]" = weakref.WeakKeyDictionary()


def _deadlines(loop: asyncio.AbstractEventLoop) -> _Deadlines:
    found = _LOOP_DEADLINES.get(loop)
    if found is None:
        found = _LOOP_DEADLINES[loop] = _Deadlines(loop)
    return found
