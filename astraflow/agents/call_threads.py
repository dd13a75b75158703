"""Plain (blocking) calls under deadlines, off the event loop, where a call may never return.

A thread cannot be killed. A fixed thread pool whose threads hang one after another ends up with
no thread left for healthy calls, which then time out behind the stuck ones. ``CallThreads`` runs
each call on a daemon thread of its own, at most ``size`` at once: a call past its deadline is
abandoned and gives its slot back, so stuck calls never starve the others, and, daemons, do not
hold up the process's exit. Tools and rewards both run this way.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any, Callable, Protocol


class CallDeadline(Exception):
    """A call ran past its deadline (apart from a ``TimeoutError`` the call raised itself)."""


class CallAbandoned(CallDeadline):
    """A coroutine past its deadline that did not stop when cancelled (it caught the cancellation):
    abandoned, left running, as a stuck thread is."""


#: seconds a coroutine past its deadline has to stop once cancelled before it is abandoned
CANCEL_GRACE_S = 1.0
#: what a coroutine that catches its own cancellation is told (``CallAbandoned``)
CANCEL_STUCK = ("did not stop when cancelled: it catches asyncio.CancelledError (a bare 'except:' or "
                "'except BaseException' around an await; re-raise it); it was abandoned, still running")


async def awaited(aw: Any, timeout_s: float) -> Any:
    """``await aw`` with a deadline: ``CallDeadline`` once ``timeout_s`` passes. Under
    ``asyncio.timeout`` a coroutine that catches its cancellation (a bare ``except:`` in a retry
    loop) would hold its caller, and the episode, forever; here it runs as a task of its own, gets
    ``CANCEL_GRACE_S`` to stop once cancelled, and is then abandoned (``CallAbandoned``)."""
    task = asyncio.ensure_future(_kept(aw))
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:  # the caller is cancelled: so is the call, whose cleanup comes first
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
        _abandon(task)
        raise
    if done:
        out = task.result()
        if isinstance(out, _Exited):
            raise out.exit
        return out
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
    _abandon(task)
    raise CallDeadline if done else CallAbandoned


class _Exited:
    def __init__(self, exit: SystemExit):
        self.exit = exit


async def _kept(aw: Any) -> Any:
    """``await aw``; a ``SystemExit`` it raises (``sys.exit`` in the code under a deadline) comes
    back as a value, for ``awaited`` to raise: out of a task it would stop the event loop."""
    try:
        return await aw
    except SystemExit as exit:
        return _Exited(exit)


def run_abandoning(coro: Any) -> Any:
    """``asyncio.run(coro)``, except that tasks still running at its end (calls ``awaited``
    abandoned) get ``CANCEL_GRACE_S`` to stop and are then left, so the run ends."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.wait(left, timeout=CANCEL_GRACE_S))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


#: abandoned tasks not ended yet: held, as a stuck thread is, since garbage collecting a coroutine
#: that catches its cancellation runs its ``except`` at whatever moment the collector picks
_ABANDONED: set[asyncio.Future] = set()


def _abandon(task: asyncio.Future) -> None:
    """What ``task`` raises, now or once it ends, is no one's: not logged as never retrieved."""
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    if not task.done():
        _ABANDONED.add(task)
        task.add_done_callback(_ABANDONED.discard)


class QueueClock(Protocol):
    """Time a thread spent queueing for something else (a sandbox slot, say): not its own running."""

    def forget_queued(self, ident: int) -> None: ...

    def queued_s(self, ident: int) -> float: ...


class _Call:
    """One call on a daemon thread of its own."""

    def __init__(self, slots: threading.Semaphore):
        self.slots = slots
        self.lock = threading.Lock()
        self.started: float | None = None
        self.ident: int | None = None
        self.dropped = False  # abandoned (past its deadline, or its caller gave up)
        self.released = False

    def release(self) -> None:
        with self.lock:
            if self.released:
                return
            self.released = True
        self.slots.release()


class CallThreads:
    """Each call on a daemon thread of its own, at most ``size`` running at once (the others queue;
    a call's deadline counts from when it starts). A call past its deadline is abandoned: its thread
    runs on unheeded and no longer counts towards ``size``. Threads whose call returned wait for
    the next one (up to ``size`` of them), so a call costs a hand-over, not a thread start; every
    call is given a thread that is free, so none waits behind a stuck one."""

    def __init__(self, size: int = 32, name: str = "astraflow-call"):
        self.size = size
        self.name = name
        self._slots = threading.Semaphore(size)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a call and not yet promised to one

    def _submit(self, job: Callable[[], None]) -> None:
        """Hand ``job`` to a waiting thread, promised to it here, or to a new one."""
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        self._jobs.put(job)
        if spawn:
            threading.Thread(target=self._work, name=self.name, daemon=True).start()

    def _work(self) -> None:
        while True:
            self._jobs.get()()
            with self._lock:
                if self._idle >= self.size:  # enough threads wait already
                    return
                self._idle += 1

    async def call(self, fn: Callable[[], Any], timeout_s: float | None, queue: QueueClock | None = None) -> Any:
        """``fn()`` on a thread; ``CallDeadline`` once it ran ``timeout_s`` seconds (None: no deadline),
        not counting the time ``queue`` says its thread waited elsewhere."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        call = _Call(self._slots)

        def run() -> None:
            self._slots.acquire()
            with call.lock:
                if call.dropped:  # given up on while it queued
                    call.released = True
                    self._slots.release()
                    return
                call.ident = threading.get_ident()
                if queue is not None:
                    queue.forget_queued(call.ident)
                call.started = time.monotonic()
            try:
                value, error = fn(), None
            except BaseException as err:
                value, error = None, err
            call.release()
            try:
                loop.call_soon_threadsafe(_answer, answer, value, error)
            except RuntimeError:  # the caller's loop has closed
                pass

        self._submit(run)
        try:
            while True:
                left = None if timeout_s is None else self._left(call, timeout_s, queue)
                if left is not None and left <= 0:
                    raise CallDeadline
                done, _ = await asyncio.wait({answer}, timeout=None if left is None else max(left, 0.005))
                if done:
                    return answer.result()
        except BaseException:
            with call.lock:
                call.dropped = True
            if call.started is not None:
                call.release()  # its slot goes to the next call; the thread runs on, unheeded
            raise

    @staticmethod
    def _left(call: _Call, timeout_s: float, queue: QueueClock | None) -> float:
        if call.started is None:
            return timeout_s
        ran = time.monotonic() - call.started
        if queue is not None and call.ident is not None:
            ran -= queue.queued_s(call.ident)
        return timeout_s - ran


def _answer(answer: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if not answer.done():
        if error is not None:
            answer.set_exception(error)
        else:
            answer.set_result(value)
