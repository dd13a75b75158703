"""How often a RaaS node with free slots asks the data layer for tasks."""

from __future__ import annotations

import asyncio

#: the pause after a lease that left slots free
RETRY_S = 0.05
#: the longest pause after leases that came back empty at once
MAX_RETRY_S = 0.4


class LeasePacing:
    """A node whose lease leaves slots free asks again after ``RETRY_S``. Leases that come back
    empty at once (the data layer did not hold the call for its long poll: the few tasks there
    were went to other nodes of a large fleet, or the node's weights are behind) double the
    pause, up to ``MAX_RETRY_S``, so a thousand nodes do not each ask twenty times a second for
    tasks that are not there. A lease that brings tasks, or one the data layer held for its long
    poll (the node was waiting there, the cheap way), resets it. The node also wakes from a long
    pause when it loads new weights."""

    def __init__(self, long_poll_s: float):
        self.long_poll_s = long_poll_s
        #: leases in a row that came back empty at once
        self.empty = 0

    def leased(self, got: int, elapsed_s: float) -> None:
        held = self.long_poll_s > 0 and elapsed_s >= self.long_poll_s / 2
        self.empty = 0 if got or held else min(self.empty + 1, 8)

    @property
    def pause_s(self) -> float:
        return min(RETRY_S * 2 ** self.empty, MAX_RETRY_S)

    async def pause(self, new_weights: asyncio.Event) -> None:
        """Wait ``pause_s``; a long pause ends when ``new_weights`` is set."""
        seconds = self.pause_s
        if seconds <= RETRY_S:
            await asyncio.sleep(seconds)
            return
        try:
            await asyncio.wait_for(new_weights.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass
