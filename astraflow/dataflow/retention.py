"""Segment retention: trajectory segments deleted once nothing can need their rows.

Why it exists: the trajectory store keeps every trajectory, and a long run's store outgrows
any quota long before its weights do. With ``storage.keep_trajectories: false`` a segment is
deleted when both hold:

* no node will write to it or complete a row of it again: its node reported it done
  (``segments_done``: filled and closed, every batch written there completed), or it was there
  when a new run incarnation started (the nodes that wrote it are gone);
* no row of it is held: not by a group being rolled out, a buffer, a batch served and not yet
  committed, or the replay pool.

The state that no longer names those rows is made durable before anything is deleted, so a
data layer restored from its change log never holds a deleted row. A node that stops or dies
keeps the segment it ended with (it never said it was done), and a data layer re-placed
mid-run forgets the segments reported to the one before: both are kept until the run is
resumed. The episode viewer then shows only the episodes still stored.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Iterable

from astraflow.dataflow.durable import refs_in

log = logging.getLogger("astraflow.dataflow")

#: seconds between two sweeps at most once a version is committed
SWEEP_EVERY_S = 10.0


def held_segments(buffers: Any) -> set[str]:
    """The segments a row held anywhere in ``buffers`` (a ``Buffers``) is stored in."""
    held = {ref.segment for ref in refs_in(buffers.rolling, buffers.ready, buffers.serving)}
    for pool in buffers.replay.values():
        held.update(it.summary.ref.segment for it in pool)
    return held


class SegmentRetention:
    """Which finished segments wait for deletion, and the sweep that deletes them."""

    def __init__(self, store: Any, enabled: bool):
        self.store, self.enabled = store, enabled
        #: segments no node writes or completes rows of any more, not yet deleted
        self.done: set[str] = set()
        self.deleted = 0
        self._last = 0.0
        self._sweeping = False
        self._task: asyncio.Task | None = None  # the sweep under way (kept: the loop holds tasks weakly)

    def segments_done(self, segments: Iterable[str]) -> None:
        if self.enabled:
            self.done.update(segments)

    def sweep_soon(self, buffers: Any, durable: Callable[[], Awaitable[None]]) -> None:
        """``sweep`` in a task of its own: the caller (a trainer's ``published``) does not wait
        for the deletions."""
        if self.done and not self._sweeping and time.monotonic() - self._last >= SWEEP_EVERY_S:
            self._task = asyncio.get_running_loop().create_task(self.sweep(buffers, durable))

    async def sweep(self, buffers: Any, durable: Callable[[], Awaitable[None]], force: bool = False) -> int:
        """Delete the done segments no held row is in (at most every ``SWEEP_EVERY_S`` unless
        ``force``); returns how many were deleted."""
        now = time.monotonic()
        if not self.done or self._sweeping or (not force and now - self._last < SWEEP_EVERY_S):
            return 0
        self._sweeping, self._last = True, now
        try:
            self.done &= set(await asyncio.to_thread(self.store.segments))  # one never stored has nothing to delete
            gone = sorted(self.done - held_segments(buffers))
            if not gone:
                return 0
            await durable()  # the state that holds none of their rows is on disk first (synced)
            self.done.difference_update(gone)
            await asyncio.to_thread(self._delete, gone)
            self.deleted += len(gone)
            return len(gone)
        finally:
            self._sweeping = False

    async def wait(self) -> None:
        """Until the sweep under way (if any) has finished."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    def _delete(self, segments: list[str]) -> None:
        for seg in segments:
            try:
                self.store.delete_segment(seg)
            except OSError as err:  # only space is at stake: the run goes on, the segment stays
                log.warning("trajectory segment %s could not be deleted (%s); it is kept", seg, err)

    def status(self) -> dict[str, int]:
        return {"segments_deleted": self.deleted, "segments_waiting": len(self.done)}
