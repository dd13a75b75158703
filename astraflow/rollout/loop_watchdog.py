"""A watchdog of a RaaS node's event loop: says where the loop is stuck when something blocks it.

A blocking call in an ``async def`` (``time.sleep`` in an agent's ``step`` or a tool, a slow
request without ``await``) stops every coroutine of the loop: heartbeats stop, and the node is
replaced as silent with no hint of why. The loop stamps the time every ``TICK_S``; a daemon
thread checks the stamp and, once per stall, logs a warning with the stack of the loop's thread,
which names the blocking frame. One watchdog per loop (nodes of a group share one), ended when
the last node on it is done.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback

log = logging.getLogger("astraflow.rollout")

#: seconds between the loop's stamps (at most a third of a stall)
TICK_S = 1.0
#: seconds without a stamp that make a stall (under the shortest lease, so it is logged before the
#: node is taken as hung)
STALL_S = 3.0

_lock = threading.Lock()
_watchdogs: dict[int, "LoopWatchdog"] = {}  # by id of the loop


class LoopWatchdog:
    """Watches one running event loop for the nodes named in ``nodes``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stall_s: float = STALL_S, tick_s: float = TICK_S):
        self.loop, self.stall_s, self.tick_s = loop, stall_s, min(tick_s, stall_s / 3)  # stamps well within a stall
        self.nodes: list[str] = []
        self.stalls = 0
        self._stamp = time.monotonic()
        self._loop_thread: int | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="raas-loop-watchdog", daemon=True)

    def start(self) -> None:
        """Start stamping (called on the loop) and watching."""
        self._loop_thread = threading.get_ident()
        self._tick()
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _tick(self) -> None:
        self._stamp = time.monotonic()
        if not self._stopped.is_set() and not self.loop.is_closed():
            self.loop.call_later(self.tick_s, self._tick)

    def _watch(self) -> None:
        stalled_since: float | None = None
        while not self._stopped.wait(self.tick_s / 2):
            if self.loop.is_closed():
                return
            late = time.monotonic() - self._stamp
            if late >= self.stall_s and stalled_since is None:
                stalled_since = self._stamp
                self.stalls += 1
                self._warn(late)
            elif late < self.stall_s and stalled_since is not None:
                log.warning("node %s: its event loop runs again after %.1f s blocked", self._names(),
                            time.monotonic() - stalled_since)
                stalled_since = None

    def _warn(self, late: float) -> None:
        frame = sys._current_frames().get(self._loop_thread)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(its thread has ended)\n"
        log.warning("node %s: its event loop has not run for %.1f s: something blocks it (a blocking call in an "
                    "async def, such as time.sleep in a step or tool: await asyncio.sleep, or run the call in a "
                    "thread with asyncio.to_thread); heartbeats wait meanwhile. The loop's thread is at:\n%s",
                    self._names(), late, stack.rstrip("\n"))

    def _names(self) -> str:
        return ", ".join(self.nodes) or "?"


def watch_loop(node: str, stall_s: float | None = None) -> LoopWatchdog:
    """The watchdog of the running loop (``stall_s``: ``STALL_S``), started for its first node;
    ``node`` is one of its nodes until ``unwatch_loop``. Called on the loop."""
    loop = asyncio.get_running_loop()
    with _lock:
        dog = _watchdogs.get(id(loop))
        if dog is None or dog.loop is not loop:
            dog = _watchdogs[id(loop)] = LoopWatchdog(loop, STALL_S if stall_s is None else stall_s)
            dog.start()
        dog.nodes.append(node)
        return dog


def unwatch_loop(dog: LoopWatchdog, node: str) -> None:
    """``node`` is done on ``dog``'s loop; the last node's going stops the watchdog."""
    with _lock:
        if node in dog.nodes:
            dog.nodes.remove(node)
        if not dog.nodes:
            dog.stop()
            if _watchdogs.get(id(dog.loop)) is dog:
                del _watchdogs[id(dog.loop)]
