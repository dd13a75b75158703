"""Trajectory store, writer room: appending entries to one segment and committing them.

Why it exists: a RaaS node publishes finished trajectories to its own segment without
talking to anyone. A ``write`` publishes its batches in two steps, the chunk data of all of
them first (written in place, ``chunks``), then one record in the segment's commit log naming
them, with a crc of each batch's bytes, made durable together with the chunk data in one flush
round (when the store is durable); readers trust only intact, backed records, so a writer
killed in between leaves nothing visible, and its successor overwrites the orphaned chunk data.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import zarr

from storage.trajectories.backends import StoreBackend
from storage.trajectories.chunks import RawArray
from storage.trajectories.layout import (
    ARRAY_DTYPES, FLAT_DTYPES, INDEX_CHUNK, INDEX_COLUMNS, REWARD_CHUNK, STRING_COLUMNS, EntryRef, Marker,
    BOOT_ID, SegmentConflict, StoredSequence, data_crc, flat_chunk, log_record,
)


#: chunks an array has room for when it is created (its shape; no chunk exists until written).
_FIRST_CHUNKS = 16


def _bytes_of(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _flat_columns(batch: list[StoredSequence]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Each per-token array of ``batch`` concatenated into one array of its stored dtype (one
    ``np.concatenate`` per column), and the entries' lengths; ``ValueError`` naming the first
    entry whose arrays are not 1-D with one value per token, or whose values do not fit."""
    flat: dict[str, np.ndarray] = {}
    lengths = np.zeros(0, np.int64)
    for k, dt in FLAT_DTYPES.items():
        parts = [getattr(r, k) for r in batch]
        try:
            lens = np.fromiter(map(len, parts), np.int64, len(parts))
            cat = np.concatenate(parts)
        except (TypeError, ValueError):  # a scalar, or arrays of mixed dimensions
            lens, cat = None, None
        if k == "tokens" and lens is not None:
            lengths = lens
        if lens is None or cat.ndim != 1 or not np.array_equal(lens, lengths):
            for r in batch:
                a, length = np.asarray(getattr(r, k)), np.asarray(r.tokens).shape[:1]
                if a.ndim != 1 or np.asarray(r.tokens).ndim != 1 or a.shape != length:
                    raise ValueError(
                        f"entry {r.task_id!r}: {k} has shape {a.shape} but tokens has shape "
                        f"{np.asarray(r.tokens).shape}; every per-token array must be 1-D with one value per token"
                    )
            raise ValueError(f"the {k} arrays of this batch cannot be joined: pass 1-D numeric arrays")
        cast = cat.astype(dt, copy=False)
        if cat.dtype != dt and not np.array_equal(cast, cat, equal_nan=cat.dtype.kind in "fc"):
            raise ValueError(f"{k} values do not fit the stored dtype {dt}: cast them before writing")
        flat[k] = cast
    return flat, lengths


class SegmentWriter:
    """Appends entries to one segment. The only process that writes (or resizes) its arrays."""

    #: test hook: called after a write's chunk data is written and before its log record exists.
    _before_commit: Callable[[], None] | None = None

    def __init__(self, backend: StoreBackend, segment: str, batch_size: int, committed: list[Marker],
                 log_end: int):
        """``committed``: the segment's committed batches, in order, and ``log_end`` the bytes
        of its commit log they take (``TrajectoryStore.writer`` reads them); the writer
        continues after the last one (a record after ``log_end`` is a crash's leftover: cut off)."""
        self._backend = backend
        self.segment = segment
        self.batch_size = batch_size
        self._closed = False
        self._log_end = log_end
        backend.prepare_segment(segment, log_end)
        self._arrays = self._open_arrays()
        self._raw = {name: RawArray.of(arr, name, ARRAY_DTYPES[name]) for name, arr in self._arrays.items()}
        # continue after the last committed batch (uncommitted chunk data is overwritten)
        last = committed[-1] if committed else None
        self._seqno = len(committed)
        self._entries = last.end if last else 0
        self._tokens = last.tok_end if last else 0

    def _open_arrays(self) -> dict[str, zarr.Array]:
        # Zarr writes only the arrays' metadata; the chunks are written in place (``chunks``)
        group = zarr.open_group(store=self._backend.zarr_store(self.segment, read_only=False), mode="a",
                                zarr_format=3)
        existing = set(group.array_keys())
        arrays: dict[str, zarr.Array] = {}
        for name, dt in FLAT_DTYPES.items():
            arrays[name] = group[name] if name in existing else group.create_array(
                name, shape=(_FIRST_CHUNKS * flat_chunk(name),), chunks=(flat_chunk(name),), dtype=dt,
                compressors=None, fill_value=0)
        arrays["index"] = group["index"] if "index" in existing else group.create_array(
            "index", shape=(_FIRST_CHUNKS * INDEX_CHUNK, len(INDEX_COLUMNS)), chunks=(INDEX_CHUNK, len(INDEX_COLUMNS)),
            dtype=np.int64, compressors=None, fill_value=0)
        arrays["reward"] = group["reward"] if "reward" in existing else group.create_array(
            "reward", shape=(_FIRST_CHUNKS * REWARD_CHUNK,), chunks=(REWARD_CHUNK,), dtype=np.float64,
            compressors=None, fill_value=0.0)
        created = [name for name in arrays if name not in existing]
        for key in ["zarr.json"] * bool(created) + [f"{name}/zarr.json" for name in created]:
            self._backend.metadata_changed(self.segment, key)  # durable with the first commit
        return arrays

    @property
    def committed(self) -> int:
        """Entries committed in this segment so far (by this writer and its predecessors)."""
        return self._entries

    def write(self, rows: list[StoredSequence]) -> list[EntryRef]:
        """Publish ``rows`` in batches of ``batch_size``; every returned ref is committed."""
        if self._closed:
            raise ValueError(f"writer of segment {self.segment!r} is closed: open a new one with store.writer()")
        # group commit: every batch's chunk data first, then one log record naming them all,
        # made durable with the data in one flush round
        seqno, e, t = self._seqno, self._entries, self._tokens
        batches: list[Marker] = []
        now = time.time()
        for i in range(0, len(rows), self.batch_size):
            batches.append(self._stage(rows[i:i + self.batch_size], seqno, e, t, now))
            seqno, e, t = seqno + 1, batches[-1].end, batches[-1].tok_end
        if not batches:
            return []
        if self._before_commit is not None:
            self._before_commit()
        record = log_record(batches)
        try:
            self._backend.publish_log(self.segment, self._log_end, record)
        except FileExistsError as err:
            raise SegmentConflict(
                f"the commit log of segment {self.segment!r} grew past what this writer committed: another "
                "writer is writing this segment; give every writer its own segment name"
            ) from err
        refs = [EntryRef(self.segment, i) for i in range(self._entries, e)]
        self._seqno, self._entries, self._tokens = seqno, e, t
        self._log_end += len(record)
        return refs

    def flush(self) -> None:
        """Nothing is buffered between calls: ``write`` publishes what it was given."""
        return None

    def close(self) -> None:
        if not self._closed:
            self._backend.release_segment(self.segment)
        self._closed = True

    def __enter__(self) -> "SegmentWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _grow(self, name: str, needed: int) -> None:
        """Over-allocate (capacity starts at ``_FIRST_CHUNKS`` chunks and grows fourfold): resizing
        rewrites the array's metadata and costs a flush, so keep it rare. The shape costs no disk (only written chunks
        exist); readers of this store go by the commits, other Zarr readers by the shape."""
        arr = self._arrays[name]
        cap, chunk = arr.shape[0], self._raw[name].chunk_rows
        if needed > cap:
            new = -(-max(needed, 4 * cap, _FIRST_CHUNKS * chunk) // chunk) * chunk
            arr.resize((new,) + tuple(arr.shape[1:]))
            self._backend.metadata_changed(self.segment, f"{name}/zarr.json")

    def _stage(self, batch: list[StoredSequence], seqno: int, e0: int, t0: int, now: float) -> Marker:
        """Write the chunk data of ``batch`` (entries from ``e0``, tokens from ``t0``); what its
        log record says of it (ranges, strings, the crc of its bytes). Nothing of it is visible yet."""
        n = len(batch)
        flat, lengths = _flat_columns(batch)
        index = np.empty((n, len(INDEX_COLUMNS)), dtype=np.int64)
        index[:, 1] = lengths
        np.cumsum(lengths[:-1], out=index[1:, 0])
        index[0, 0] = 0
        index[:, 0] += t0
        index[:, 2] = [r.seq_index for r in batch]
        index[:, 3] = [r.num_sequences for r in batch]
        rewards = np.array([float(r.reward) for r in batch], dtype=np.float64)
        strings = {c: [getattr(r, c) for r in batch] for c in STRING_COLUMNS}
        for c, vals in strings.items():
            if not all(isinstance(v, str) for v in vals):
                bad = next(v for v in vals if not isinstance(v, str))
                raise ValueError(f"StoredSequence.{c} must be str, got {type(bad).__name__}")
        t1, e1 = t0 + int(lengths.sum()), e0 + n
        for k in FLAT_DTYPES:
            self._grow(k, t1)
        self._grow("index", e1)
        self._grow("reward", e1)
        parts = [*((k, t0, flat[k]) for k in FLAT_DTYPES), ("index", e0, index), ("reward", e0, rewards)]
        views = [_bytes_of(data) for _, _, data in parts]  # in ``CRC_ORDER``
        for (name, start, data), buf in zip(parts, views):
            if len(data):
                self._backend.write_chunks(self.segment, self._raw[name].pieces(start, start + len(data)), buf)
        return Marker(seqno, e0, e1, t0, t1, strings, now, data_crc(views), BOOT_ID)
