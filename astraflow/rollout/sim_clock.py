"""The clocks of the simulated engine: real time (optionally sped up) or virtual time.

A clock has ``now()``, ``async wait(event, seconds)`` (wait up to ``seconds`` of simulated time
or until ``event`` is set; returns the simulated seconds that passed) and ``block(seconds)``
(a blocking wait, for work done off the event loop such as loading weights).
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    async def wait(self, event: asyncio.Event, seconds: float) -> float: ...

    def block(self, seconds: float) -> None: ...


class RealClock:
    """Wall-clock time; ``scale`` simulated seconds pass per real second."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def now(self) -> float:
        return time.monotonic() * self.scale

    async def wait(self, event: asyncio.Event, seconds: float) -> float:
        t0 = self.now()
        try:
            await asyncio.wait_for(event.wait(), max(seconds, 0.0) / self.scale)
        except TimeoutError:
            pass
        return self.now() - t0

    def block(self, seconds: float) -> None:
        time.sleep(seconds / self.scale)


class VirtualClock:
    """Simulated time that jumps: ``wait`` lets the other coroutines run (a few loop turns, so
    that a request submitted in reply to a finished one arrives first), then advances the clock
    by ``seconds`` (at most ``max_step``, so a test can act between steps) unless the event was
    set meanwhile. ``block`` takes no simulated time: the engine's timeline is the only one.
    Meant for one engine's timeline in a test."""

    def __init__(self, turns: int = 8, max_step: float = float("inf")):
        self.t = 0.0
        self.turns = turns
        self.max_step = max_step

    def now(self) -> float:
        return self.t

    async def wait(self, event: asyncio.Event, seconds: float) -> float:
        for _ in range(self.turns):
            await asyncio.sleep(0)
            if event.is_set():
                return 0.0
        step = min(max(seconds, 0.0), self.max_step)
        self.t += step
        return step

    def block(self, seconds: float) -> None:
        pass
