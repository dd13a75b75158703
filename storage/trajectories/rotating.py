"""Trajectory store, rotation room: one writer's entries over a series of segments.

Why it exists: a reader opening a segment parses its whole commit log, so a segment a node
appended to for its whole life makes every open (a resume, a restarted trainer, the episode
viewer) cost time and memory in proportion to the run's history. ``RotatingWriter`` moves to
a new segment once the current one holds ``max_entries``; each segment's log stays bounded, and
a segment nobody appends to any more is a unit that can be archived or deleted as a whole.

The segments are ``<base>`` then ``<base>.1``, ``<base>.2``, ...; a ref names its segment, so
readers need nothing new. A rotation closes the full segment (its queued commits made durable
first: one flush round, once per ``max_entries``) before the next batch is staged.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

from storage.trajectories.layout import EntryRef, StoredSequence
from storage.trajectories.writer import SegmentWriter

if TYPE_CHECKING:
    from storage.trajectories.reader import TrajectoryStore

#: segment writers of one process are opened one at a time (their first write may set up the
#: store's shared files)
_OPENING = threading.Lock()


class RotatingWriter:
    """``SegmentWriter``'s interface (``submit``, ``write``, ``flush``, ``close``) over segments
    of at most about ``max_entries`` entries each (a call's rows all go to one segment)."""

    def __init__(self, store: "TrajectoryStore", base: str, batch_size: int, max_entries: int):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self._store, self._base, self._batch_size, self.max_entries = store, base, batch_size, max_entries
        self._lock = threading.Lock()  # one call at a time: a rotation swaps the writer under it
        self._index = 0
        self._current = self._open(base)
        self._staged = self._current.committed  # entries staged in the current segment
        #: the segments this writer filled and closed since the last ``take_closed``, oldest first
        self.closed_segments: list[str] = []

    def _open(self, segment: str) -> SegmentWriter:
        with _OPENING:
            return self._store.writer(segment, batch_size=self._batch_size)

    @property
    def segment(self) -> str:
        """The segment being appended to now."""
        return self._current.segment

    @property
    def committed(self) -> int:
        """Entries committed in the current segment."""
        return self._current.committed

    def _writer_for(self, n: int) -> SegmentWriter:
        """The writer ``n`` more rows go to: the next segment once the current one is full."""
        if n and self._staged >= self.max_entries:
            full = self._current
            self._index += 1
            self._current = self._open(f"{self._base}.{self._index}")
            self._staged = 0
            full.close()  # what it queued is committed before the segment is released
            self.closed_segments.append(full.segment)
        self._staged += n
        return self._current

    def take_closed(self) -> list[str]:
        """The segments filled and closed since the last call, oldest first; forgotten here, so a
        writer of a long run holds only those its caller has not taken yet."""
        with self._lock:
            taken, self.closed_segments = self.closed_segments, []
        return taken

    def submit(self, rows: list[StoredSequence]) -> "Future[list[EntryRef]]":
        with self._lock:
            return self._writer_for(len(rows)).submit(rows)

    def write(self, rows: list[StoredSequence]) -> list[EntryRef]:
        with self._lock:
            return self._writer_for(len(rows)).write(rows)

    def flush(self) -> None:
        with self._lock:
            writer = self._current
        writer.flush()

    def close(self) -> None:
        with self._lock:
            self._current.close()

    def __enter__(self) -> "RotatingWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
