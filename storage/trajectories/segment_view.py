"""Trajectory store, reader room: what one store object knows about one segment.

A ``SegmentView`` trusts only what a segment's commit markers (segments written before the
commit log) and then its commit log's intact records commit, and reads any stretch of an
array's entries as one read per packed batch (or per chunk, for batches written before
packing). ``KeptStrings`` bounds the parsed string columns a long-lived reader holds.
"""

from __future__ import annotations

import bisect
import json
from collections import OrderedDict

import numpy as np
from zarr.core.metadata.v3 import ArrayV3Metadata

from storage.trajectories.backends import StoreBackend
from storage.trajectories.chunks import RawArray
from storage.trajectories.layout import (
    ARRAY_DTYPES, BOOT_ID, CRC_ORDER, DATA_ARRAY, FLAT_DTYPES, INDEX_COLUMNS, Marker, data_crc, parse_log,
    record_strings, row_bytes,
)

#: entries whose string columns a store object keeps parsed (the ones used last); the others'
#: are read back from their commit log record or marker when a read needs them again
KEPT_STRINGS = 1 << 14


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
