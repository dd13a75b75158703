"""Trajectory store, reader room: opening a store, finding what is committed, reading entries.

Why it exists: the data layer and trainers read entries that RaaS nodes committed, by
reference, without a lock and while writers keep appending. A reader trusts only what a
segment's commit markers (segments written before the commit log) and then its commit log's
intact records commit, and reads a batch of entries with one read per array per batch (packed
batches) or per chunk per array (batches written before packing) per run of nearby entries.
"""

from __future__ import annotations

import bisect
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from zarr.core.metadata.v3 import ArrayV3Metadata

from storage import paths
from storage.trajectories.backends import StoreBackend, open_backend
from storage.trajectories.chunks import RawArray
from storage.trajectories.columns import Columns, empty_columns
from storage.trajectories.layout import (
    ARRAY_DTYPES, BOOT_ID, CRC_ORDER, DATA_ARRAY, FLAT_DTYPES, INDEX_COLUMNS, LAYOUT_VERSION, READABLE_LAYOUTS,
    STRING_COLUMNS, EntryNotCommitted, EntryRef, Marker, StoredSequence, data_crc, layout_record, parse_log,
    record_strings, row_bytes,
)
from storage.trajectories.writer import SegmentWriter

#: token gap below which read() fetches one covering slice instead of two.
_MERGE_GAP_TOKENS = 32 * 1024
#: refs of one segment further apart than this many entries read their index rows separately
_MERGE_GAP_ENTRIES = 4096
#: entries whose string columns a store object keeps parsed (the ones used last); the others'
#: are read back from their commit log record or marker when a read needs them again
KEPT_STRINGS = 1 << 14


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


class KeptStrings:
    """The batches whose string columns a store object keeps in memory, least recently used
    first, at most ``budget`` entries' worth: a long-lived reader (a trainer) would otherwise
    hold every string it ever read. A batch pushed out gets ``strings = None``."""

    def __init__(self, budget: int = KEPT_STRINGS):
        self.budget = budget
        self.held = 0  # entries whose strings are kept
        self._order: OrderedDict[int, Marker] = OrderedDict()

    def touch(self, m: Marker) -> None:
        if self._order.get(id(m)) is m:
            self._order.move_to_end(id(m))
            return
        self._order[id(m)] = m
        self.held += m.end - m.start
        while self.held > self.budget and self._order:
            _, old = self._order.popitem(last=False)
            self.held -= old.end - old.start
            old.strings = None


class SegmentView:
    """What one store object (or a writer resuming a segment) knows about one segment: its
    published batches (immutable once published), how much of its commit log they take, and
    the chunk layout of its arrays (fixed at creation)."""

    def __init__(self, backend: StoreBackend, segment: str, kept: KeptStrings | None = None):
        self.backend = backend
        self.segment = segment
        self.kept = kept if kept is not None else KeptStrings()
        self.markers: list[Marker] = []
        self.starts: list[int] = []  # each batch's first entry
        self.tok_starts: list[int] = []  # and first token
        #: the first packed batch (``len(markers)`` while there is none): the batches before it
        #: keep each array in an array of its own
        self.first_packed = 0
        self.data_end = 0  # end of the packed bytes in ``data``
        self.loaded = False
        #: bytes of the commit log whose records are committed (the next record starts there).
        self.log_end = 0
        self._raw: dict[str, RawArray] = {}

    @property
    def committed(self) -> int:
        return self.markers[-1].end if self.markers else 0

    def refresh(self) -> None:
        """Take in what was committed since the last call: commit markers first (gap-free from
        0; segments written before the commit log), then the commit log's records after
        ``log_end``. A record counts once a later record follows it (its writer appended that
        only after the record's flush round returned), or, for the last one, when this machine
        wrote it in its current boot (its data was written first, into the page cache read
        here), or once the bytes it covers match its data crcs: a crash during the round may
        have kept the record and lost data, and a reader on another machine may see the record
        before the data. The first record that is cut short, damaged or not backed by its data
        ends what is committed, for now."""
        if not self.loaded:
            for seqno in self.backend.list_markers(self.segment):
                if seqno != len(self.markers):
                    break  # markers are gap-free; anything after a gap is not committed
                self._add(Marker.parse(seqno, self._marker(seqno)))
            self.loaded = True
        while self.log_end == 0 and (data := self.backend.read_marker(self.segment, len(self.markers))):
            self._add(Marker.parse(len(self.markers), data))  # a writer of markers (older code) went on
        base = self.log_end
        records = parse_log(self.backend.read_log(self.segment, base), self.markers[-1] if self.markers else None,
                            self.data_end, base)
        for k, (end, batches) in enumerate(records):
            if k == len(records) - 1 and not (BOOT_ID and batches[0].boot == BOOT_ID) \
                    and not all(self._backed(m) for m in batches):
                return
            for m in batches:
                self._add(m)
            self.log_end = base + end

    def _marker(self, seqno: int) -> bytes:
        data = self.backend.read_marker(self.segment, seqno)
        assert data is not None, f"marker {seqno} of {self.segment} vanished"
        return data

    def _backed(self, m: Marker) -> bool:
        """Whether the bytes batch ``m`` covers are the ones its writer wrote (``data_crc``)."""
        try:
            if m.packed:
                parts = [self._read_bytes(m.data_at, m.data_end)]
            else:
                parts = [self.rows(name, *((m.tok_start, m.tok_end) if name in FLAT_DTYPES else (m.start, m.end)))
                         for name in CRC_ORDER]
        except (FileNotFoundError, ValueError):  # an array's metadata missing or not whole
            return False
        except OSError as err:
            if err.errno is not None:  # an I/O error says nothing of the record: not a verdict
                raise
            return False  # a chunk file shorter than the record needs (``read_chunks``)
        return data_crc(memoryview(p.reshape(-1).view(np.uint8)) for p in parts) == m.data_crc

    def _add(self, m: Marker) -> None:
        assert m.start == self.committed, f"segment {self.segment}: batch {m.seqno} does not continue the last one"
        if not m.packed:
            self.first_packed = len(self.markers) + 1
        else:
            self.data_end = m.data_end
        self.markers.append(m)
        self.starts.append(m.start)
        self.tok_starts.append(m.tok_start)
        self.kept.touch(m)

    def strings_of(self, m: Marker) -> dict[str, list[str]]:
        """Batch ``m``'s string columns, read back from its record or marker if they were dropped."""
        got = m.strings
        if got is None:
            if m.record is not None:
                at, end, k = m.record
                got = m.strings = record_strings(self.backend.read_log(self.segment, at, end - at), k)
            else:
                got = m.strings = Marker.parse(m.seqno, self._marker(m.seqno)).strings
        self.kept.touch(m)  # may drop them again at once (a batch bigger than the budget)
        return got

    def _raw_array(self, name: str) -> RawArray:
        raw = self._raw.get(name)
        if raw is None:
            # Zarr v3 only (what the writer creates), parsed from its ``zarr.json`` here (Zarr's
            # own opening goes through its event loop): v3 has no object dtype, so no pickle
            # codec can decode a chunk; a forged v2 ``.zarray`` naming one is never opened. The
            # array's shape is not consulted: the markers say what is committed.
            key = f"{name}/zarr.json"
            data = self.backend.read_metadata(self.segment, key)
            if data is None:
                raise FileNotFoundError(f"segment {self.segment!r} has committed entries but no {key}: it is damaged")
            rec = json.loads(data)
            if not isinstance(rec, dict) or rec.get("zarr_format") != 3 or rec.get("node_type") != "array":
                raise ValueError(f"{key} of segment {self.segment!r} is not a Zarr v3 array's metadata")
            meta = ArrayV3Metadata.from_dict(rec)
            dtype = np.dtype(np.uint8) if name == DATA_ARRAY else ARRAY_DTYPES[name]
            raw = self._raw[name] = RawArray.from_metadata(meta, name, dtype)
        return raw

    def _pieces(self, name: str, start: int, stop: int, at: int) -> list:
        """Byte ranges (``chunks.Piece``) holding rows ``[start, stop)`` of array ``name`` (tokens
        of a per-token array, entries of the others), for a buffer that holds them from byte
        ``at``: through the per-array layout up to the first packed batch, then a range of
        ``data`` per packed batch."""
        rb = row_bytes(name)
        starts = self.tok_starts if name in FLAT_DTYPES else self.starts
        # rows before the first packed batch are in the per-array layout; while there is none,
        # every row is (also those of a batch ``_backed`` checks before it is added)
        split = starts[self.first_packed] if self.first_packed < len(starts) else stop
        pieces = []
        if start < split:
            pieces = self._raw_array(name).pieces(start, min(stop, split), at)
            at, start = at + (min(stop, split) - start) * rb, min(stop, split)
        k = bisect.bisect_right(starts, start) - 1  # the last batch from ``start`` (past empty ones)
        data = self._raw_array(DATA_ARRAY) if start < stop else None
        while start < stop:
            m = self.markers[k]
            first, last = (m.tok_start, m.tok_end) if name in FLAT_DTYPES else (m.start, m.end)
            end = min(stop, last)
            b = m.offset(name) + (start - first) * rb
            pieces += data.pieces(b, b + (end - start) * rb, at)
            at, start, k = at + (end - start) * rb, end, k + 1
        return pieces

    def _read_bytes(self, start: int, stop: int) -> np.ndarray:
        """Bytes ``[start, stop)`` of the packed ``data`` array."""
        out = np.empty(stop - start, np.uint8)
        self.backend.read_chunks(self.segment, self._raw_array(DATA_ARRAY).pieces(start, stop), memoryview(out))
        return out

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of array ``name``: one read per covering chunk (and packed
        batch), straight into the returned array. The caller checked that a marker covers them."""
        out = np.empty((stop - start, len(INDEX_COLUMNS)) if name == "index" else stop - start, ARRAY_DTYPES[name])
        if stop > start:
            self.backend.read_chunks(self.segment, self._pieces(name, start, stop, 0),
                                     memoryview(out.reshape(-1).view(np.uint8)))
        return out

    def read_into(self, name: str, start: int, stop: int, out: np.ndarray, at: int) -> None:
        """Rows ``[start, stop)`` of array ``name`` into ``out[at:]`` (C-contiguous, that dtype)."""
        if stop > start:
            self.backend.read_chunks(self.segment, self._pieces(name, start, stop, at * row_bytes(name)),
                                     memoryview(out.reshape(-1).view(np.uint8)))


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
        self._views: dict[str, SegmentView] = {}
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
