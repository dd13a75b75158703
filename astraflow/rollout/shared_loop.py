"""One asyncio event loop shared by every RaaS node of a process (``rollout.nodes_per_worker``).

A node normally runs its loop in a thread of its own. Sim nodes do no work of their own (their
engines only sleep), so many of them share one loop in one thread: ``run(coro)`` schedules a
node's main coroutine there and returns a handle that joins like a thread. The blocking calls
the nodes make off the loop (actor calls, trajectory writes, weight polls: ``asyncio.to_thread``)
go to the loop's executor, sized with the number of nodes so that a node's heartbeat never waits
behind other nodes' long polls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Coroutine

#: executor threads per node on the shared loop: a lease long poll, a heartbeat or completion,
#: a trajectory write and a weight poll can each be blocked at once
THREADS_PER_NODE = 4

_lock = threading.Lock()
_shared: "SharedLoop | None" = None


class LoopTask:
    """A coroutine running on the shared loop, joined like a thread."""

    def __init__(self, future: concurrent.futures.Future):
        self.future = future

    def join(self, timeout: float | None = None) -> None:
        try:
            self.future.result(timeout)
        except concurrent.futures.TimeoutError:
            pass
        except BaseException:  # the coroutine's error is the node's to report (``RaaSNode.error``)
            pass

    def is_alive(self) -> bool:
        return not self.future.done()


class SharedLoop:
    """An event loop running forever in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.nodes = 0
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.thread = threading.Thread(target=self.loop.run_forever, name="raas-shared-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any]) -> LoopTask:
        """Schedule a node's main coroutine; one more node sizes the executor up."""
        with _lock:
            self.nodes += 1
            workers = max(self.nodes * THREADS_PER_NODE, 8)
            if self._executor is None or self._executor._max_workers < workers:
                # threads are started lazily: a generous pool costs only what is used
                self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=2 * workers,
                                                                       thread_name_prefix="raas-shared")
                self.loop.call_soon_threadsafe(self.loop.set_default_executor, self._executor)
        return LoopTask(asyncio.run_coroutine_threadsafe(coro, self.loop))


def shared_loop() -> SharedLoop:
    """The process's shared loop, started on first use."""
    global _shared
    with _lock:
        if _shared is None:
            _shared = SharedLoop()
        return _shared
