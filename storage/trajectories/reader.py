"""Trajectory store, reader room: opening a store, finding what is committed, reading entries.

Why it exists: the data layer and trainers read entries that RaaS nodes committed, by
reference, without a lock and while writers keep appending. A reader trusts only what each
segment's view (``segment_view``) says is committed, and reads a batch of entries with one read
per array per batch (packed batches) or per chunk per array (batches written before packing)
per run of nearby entries.
"""

from __future__ import annotations

import bisect
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from storage import paths
from storage.trajectories.backends import StoreBackend, open_backend
from storage.trajectories.columns import Columns, empty_columns
from storage.trajectories.layout import (
    FLAT_DTYPES, INDEX_COLUMNS, LAYOUT_VERSION, READABLE_LAYOUTS, STRING_COLUMNS, EntryNotCommitted, EntryRef,
    StoredSequence, layout_record,
)
from storage.trajectories.segment_view import KeptStrings, SegmentView
from storage.trajectories.writer import SegmentWriter

#: token gap below which read() fetches one covering slice instead of two.
_MERGE_GAP_TOKENS = 32 * 1024
#: refs of one segment further apart than this many entries read their index rows separately
_MERGE_GAP_ENTRIES = 4096
#: segments whose views (their batches' markers, parsed from the commit log) a store object keeps,
#: the ones used last: a long-lived reader (a trainer) meets every segment of a run, one after another
#: as nodes rotate them; a view dropped is parsed again from its commit log if ever read again
KEPT_VIEWS = 1024


def open_trajectory_store(url: str, mode: str = "a", *, durable: bool = True) -> "TrajectoryStore":
    """Open (``mode="r"``: must exist) or open-or-create (``mode="a"``) a trajectory store.

    ``url``: a directory path, ``file:///abs/path`` (shared filesystem), or ``memory://<name>``
    (in-process). ``durable`` (directories only): fsync chunk data and the commit log before a batch
    counts as committed, so a committed entry survives a machine crash, not only a process
    crash. Turning it off trades that for speed on scratch stores.
    """
    if mode not in ("r", "a"):
        raise ValueError(f"mode must be 'r' (existing store, read-only) or 'a' (create if absent), got {mode!r}")
    if not isinstance(url, (str, os.PathLike)):
        raise ValueError(f"store url must be a string path or URL, got {type(url).__name__}")
    return TrajectoryStore(open_backend(os.fspath(url), mode, durable), mode)


@dataclass(frozen=True)
class CommittedBatch:
    """One published batch of a segment without its tokens (``TrajectoryStore.batch``): its
    entries ``[start, end)``, when it was published, its string columns, rewards and index rows."""

    segment: str
    seqno: int
    start: int
    end: int
    written_at: float
    strings: dict[str, list[str]]
    rewards: np.ndarray  # float64, one per entry
    index: np.ndarray  # int64 (entries, len(INDEX_COLUMNS)): offset, length, seq_index, num_sequences


class TrajectoryStore:
    """A trajectory store opened by one process. Not thread-safe; open one per thread."""

    def __init__(self, backend: StoreBackend, mode: str):
        self._backend = backend
        self._mode = mode
        layout = backend.read_layout()
        if layout is None:
            if mode == "r":
                raise FileNotFoundError(
                    f"no trajectory store at {backend.describe()} (no {paths.store_layout_file(Path('.')).name}): "
                    "check the path, or open it with mode='a' to create one"
                )
            backend.create_layout(layout_record())
            layout = backend.read_layout()
            assert layout is not None
        rec = json.loads(layout)
        found = rec.get("layout_version")
        if found not in READABLE_LAYOUTS:
            raise ValueError(
                f"trajectory store at {backend.describe()} has layout version {found}, this code reads "
                f"versions {', '.join(map(str, READABLE_LAYOUTS))}: read it with the AstraFlow version that "
                "wrote it, or point this run at a new store directory"
            )
        self._layout = rec
        self._views: OrderedDict[str, SegmentView] = OrderedDict()  # least recently used first
        self.kept = KeptStrings()  # shared by the views: a budget per store object

    @property
    def url(self) -> str:
        return self._backend.describe()

    @property
    def supports_multiprocess(self) -> bool:
        """True when writers and readers in other processes (and nodes) see the same store."""
        return self._backend.supports_multiprocess

    def writer(self, segment: str, batch_size: int = 64) -> SegmentWriter:
        """The writer of ``segment`` (created if absent). One live writer per segment: a second
        one is detected only when both publish the same marker (``SegmentConflict``)."""
        if self._mode == "r":
            raise ValueError(f"store {self.url} was opened with mode='r': open it with mode='a' to write")
        paths.check_name("segment", segment)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if self._layout.get("layout_version") != LAYOUT_VERSION:
            # the segments this store gets from now on commit through logs: code that reads only
            # markers must refuse the store rather than miss them
            self._layout = {**self._layout, "layout_version": LAYOUT_VERSION}
            self._backend.replace_layout(json.dumps(self._layout, sort_keys=True).encode())
        view = SegmentView(self._backend, segment, KeptStrings(0))
        view.refresh()  # the writer continues after the last committed batch (its strings not needed)
        return SegmentWriter(self._backend, segment, batch_size, view.markers, view.log_end)

    def segments(self) -> list[str]:
        return self._backend.list_segments()

    def delete_segment(self, segment: str) -> None:
        """Remove ``segment`` for good (the caller's word: nothing needs its rows); gone already is no error."""
        if self._mode == "r":
            raise ValueError(f"store {self.url} was opened with mode='r': open it with mode='a' to delete")
        self._views.pop(paths.check_name("segment", segment), None)
        self._backend.delete_segment(segment)

    def _view(self, segment: str) -> SegmentView:
        v = self._views.get(segment)
        if v is None:
            v = self._views[segment] = SegmentView(self._backend, paths.check_name("segment", segment), self.kept)
            while len(self._views) > KEPT_VIEWS:
                self._views.popitem(last=False)
        else:
            self._views.move_to_end(segment)
        return v

    def read(self, refs: list[EntryRef]) -> list[StoredSequence]:
        """The entries ``refs`` name, in that order, exactly as written, one ``StoredSequence``
        each with arrays of its own (``read_columns``, then copied out per entry: a caller keeping
        a few entries does not keep the whole read alive). ``EntryNotCommitted`` for an
        uncommitted ref."""
        return self.read_columns(refs).rows(copy=True)

    def read_columns(self, refs: list[EntryRef]) -> Columns:
        """The entries ``refs`` name, in that order, as concatenated columns (``Columns``): one
        read per array per batch (per chunk, where it crosses one) per run of nearby entries,
        each run's bytes copied once into the columns (read straight into them when the run is
        one stretch of consecutive entries), no per-entry objects. ``EntryNotCommitted`` names the
        first uncommitted refs."""
        n = len(refs)
        if not n:
            return empty_columns()
        seg_ids: dict[str, int] = {}
        seg = np.fromiter((seg_ids.setdefault(r.segment, len(seg_ids)) for r in refs), np.int64, n)
        idx = np.fromiter((r.index for r in refs), np.int64, n)
        views = [self._view(s) for s in seg_ids]
        index, reward = self._index_rows(views, seg, idx)
        lengths = index[:, 1]
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        cols = {k: np.empty(int(offsets[-1]), dt) for k, dt in FLAT_DTYPES.items()}
        # spans: stretches of refs naming consecutive entries of one segment (contiguous on disk
        # and in the columns): (segment, first entry, end entry, first token, end token, offset)
        cut = np.flatnonzero((seg[1:] != seg[:-1]) | (idx[1:] != idx[:-1] + 1)) + 1
        first, last = np.concatenate([[0], cut]), np.concatenate([cut, [n]]) - 1
        spans = list(zip(seg[first].tolist(), idx[first].tolist(), (idx[last] + 1).tolist(),
                         index[first, 0].tolist(), (index[last, 0] + lengths[last]).tolist(),
                         offsets[first].tolist()))
        strings = self._strings(views, spans)
        self._read_tokens(views, spans, cols)
        return Columns(list(refs), offsets, *cols.values(), index[:, 2].copy(), index[:, 3].copy(), reward,
                       *(strings[c] for c in STRING_COLUMNS))

    def _index_rows(self, views: list["SegmentView"], seg: np.ndarray, idx: np.ndarray) -> tuple:
        """The index rows and rewards of the entries (``seg``: each one's view, ``idx``: its
        entry): one covering slice per segment, or one per run of nearby entries where they lie
        far apart. ``EntryNotCommitted`` for an entry past a segment's committed ones."""
        n = len(idx)
        index, reward = np.empty((n, len(INDEX_COLUMNS)), np.int64), np.empty(n, np.float64)
        for s, view in enumerate(views):
            pos = np.flatnonzero(seg == s) if len(views) > 1 else np.arange(n)
            ix = idx[pos]
            lo, hi = int(ix.min()), int(ix.max()) + 1
            if hi > view.committed:
                view.refresh()
            bad = (ix < 0) | (ix >= view.committed)
            if bad.any():
                names = [f"{view.segment}:{i}" for i in ix[bad][:5].tolist()]
                raise EntryNotCommitted(
                    f"segment {view.segment!r} of {self.url} has {view.committed} committed entries; asked for "
                    f"uncommitted entries {names}: pass only refs returned by write()"
                )
            if hi - lo <= _MERGE_GAP_ENTRIES:
                index[pos] = view.rows("index", lo, hi)[ix - lo]
                reward[pos] = view.rows("reward", lo, hi)[ix - lo]
                continue
            order = np.argsort(ix, kind="stable")
            sx = ix[order]
            cuts = np.flatnonzero(np.diff(sx) > _MERGE_GAP_ENTRIES) + 1
            for a, b in zip(np.concatenate([[0], cuts]).tolist(), np.concatenate([cuts, [len(sx)]]).tolist()):
                lo, hi, sel = int(sx[a]), int(sx[b - 1]) + 1, pos[order[a:b]]
                index[sel] = view.rows("index", lo, hi)[sx[a:b] - lo]
                reward[sel] = view.rows("reward", lo, hi)[sx[a:b] - lo]
        return index, reward

    @staticmethod
    def _strings(views: list["SegmentView"], spans: list[tuple]) -> dict[str, list[str]]:
        """The string columns of the spans' entries, in order: a slice of each marker's strings."""
        strings: dict[str, list[str]] = {c: [] for c in STRING_COLUMNS}
        for s, e0, e1, *_ in spans:
            view = views[s]
            k = bisect.bisect_right(view.starts, e0) - 1
            while e0 < e1:
                m = view.markers[k]
                j0, j1 = e0 - m.start, min(e1, m.end) - m.start
                got = view.strings_of(m)
                for c in STRING_COLUMNS:
                    strings[c].extend(got[c][j0:j1])
                e0, k = m.start + j1, k + 1
        return strings

    def _read_tokens(self, views: list["SegmentView"], spans: list[tuple], cols: dict[str, np.ndarray]) -> None:
        """The spans' token arrays into ``cols``: spans sorted by token offset and merged when
        close, one read per array per run, straight into the columns when a run is one span."""
        for s, view in enumerate(views):
            mine = sorted(sp for sp in spans if sp[0] == s) if len(views) > 1 else sorted(spans)
            run: list = []
            end = 0
            for sp in mine:
                if run and sp[3] - end > _MERGE_GAP_TOKENS:
                    self._copy_run(view, run, end, cols)
                    run = []
                end = max(end, sp[4]) if run else sp[4]
                run.append(sp)
            self._copy_run(view, run, end, cols)

    @staticmethod
    def _copy_run(view: "SegmentView", run: list, t1: int, cols: dict[str, np.ndarray]) -> None:
        """Tokens ``[first span's start, t1)`` of ``view`` into the spans' places in ``cols``."""
        t0 = run[0][3]
        for name, out in cols.items():
            if len(run) == 1:
                view.read_into(name, t0, t1, out, run[0][5])
                continue
            buf = view.rows(name, t0, t1)
            for *_, a, b, at in run:
                out[at:at + b - a] = buf[a - t0:b - t0]

    def batch_count(self, segment: str) -> int:
        """Published batches of ``segment`` (what this store object knows, brought up to date:
        only the commit log's bytes appended since the last call are read)."""
        view = self._view(segment)
        view.refresh()
        return len(view.markers)

    def batch(self, segment: str, seqno: int) -> CommittedBatch:
        """Published batch ``seqno`` of ``segment`` (its record plus one small read of the reward
        and index arrays, no tokens). Immutable once published: callers may cache it.
        ``EntryNotCommitted`` when no such batch is committed."""
        view = self._view(segment)
        if seqno >= len(view.markers):
            view.refresh()
        if not 0 <= seqno < len(view.markers):
            raise EntryNotCommitted(f"segment {segment!r} of {self.url} has no published batch {seqno}")
        m = view.markers[seqno]
        index, reward = view.rows("index", m.start, m.end), view.rows("reward", m.start, m.end)
        return CommittedBatch(segment, seqno, m.start, m.end, m.written_at, view.strings_of(m),
                              np.asarray(reward, np.float64), np.asarray(index, np.int64))

    def count(self, segment: str) -> int:
        """Committed entries of ``segment`` (0 for an unknown one)."""
        view = self._view(segment)
        view.refresh()
        return view.committed
