"""Trajectory store, writer room: appending entries to one segment and committing them.

Why it exists: a RaaS node publishes finished trajectories to its own segment without
talking to anyone. A ``write`` publishes its batches in two steps, the bytes of all of them
first (each batch's arrays packed one after another and appended to the segment's ``data``
array in place, ``chunks``), then one record in the segment's commit log naming them, with
where each batch starts and a crc of its bytes, made durable together with the data in one
flush round (when the store is durable); readers trust only intact, backed records, so a
writer killed in between leaves nothing visible, and its successor overwrites the orphaned
bytes. Packing keeps a batch in one stretch of ``data`` (one chunk file unless it crosses a
chunk boundary), so that round flushes a file or two and the log, not one file per array.

Commits are grouped: ``submit`` writes a batch's bytes at once and hands it to the writer's
committer thread, which names everything staged since its last round in one record and one
flush round. A node that stages its next batch while the previous one is being made durable
pays one flush round for several batches; ``write`` is ``submit`` and wait.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, wait
from typing import Callable

import numpy as np
import zarr

from storage.trajectories.backends import StoreBackend
from storage.trajectories.chunks import RawArray
from storage.trajectories.layout import (
    BOOT_ID, CRC_ORDER, DATA_ARRAY, DATA_CHUNK, FLAT_DTYPES, INDEX_COLUMNS, STRING_COLUMNS, EntryRef, Marker,
    SegmentConflict, StoredSequence, data_crc, log_record, packed_offsets,
)


#: chunks an array has room for when it is created (its shape; no chunk exists until written).
_FIRST_CHUNKS = 16
#: a packed batch up to this size is joined into one buffer and written at once
_JOIN_BYTES = 256 << 10


def _bytes_of(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _flat_columns(batch: list[StoredSequence]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Each per-token array of ``batch`` concatenated into one array of its stored dtype (one
    ``np.concatenate`` per column), and the entries' lengths; ``ValueError`` naming the first
    entry whose arrays are not 1-D with one value per token, or whose values do not fit."""
    flat: dict[str, np.ndarray] = {}
    lengths: list[int] = []  # the tokens' (the first column); lists: cheaper to compare for a few entries
    for k, dt in FLAT_DTYPES.items():
        parts = [getattr(r, k) for r in batch]
        try:
            lens = list(map(len, parts))
            cat = np.concatenate(parts)
        except (TypeError, ValueError):  # a scalar, or arrays of mixed dimensions
            lens, cat = None, None
        if k == "tokens" and lens is not None:
            lengths = lens
        if lens is None or cat.ndim != 1 or lens != lengths:
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
    return flat, np.array(lengths, np.int64)


class SegmentWriter:
    """Appends entries to one segment. The only process that writes (or resizes) its arrays."""

    #: test hook: called after a write's chunk data is written and before its log record exists.
    _before_commit: Callable[[], None] | None = None

    def __init__(self, backend: StoreBackend, segment: str, batch_size: int, committed: list[Marker],
                 log_end: int):
        """``committed``: the segment's committed batches, in order, and ``log_end`` the bytes
        of its commit log they take (``TrajectoryStore.writer`` reads them); the writer
        continues after the last one (a record after ``log_end`` is a crash's leftover: cut off).
        A segment whose batches were written before packing goes on with packed batches."""
        self._backend = backend
        self.segment = segment
        self.batch_size = batch_size
        self._closed = False
        self._log_end = log_end
        backend.prepare_segment(segment, log_end)
        self._data = self._open_data()
        self._raw = RawArray.of(self._data, DATA_ARRAY, np.dtype(np.uint8))
        # continue after the last committed batch (uncommitted bytes are overwritten)
        last = committed[-1] if committed else None
        self._entries = last.end if last else 0  # committed
        # where the next staged batch goes: seqno, entry, token, byte (packed batches come last)
        self._next = (len(committed), self._entries, last.tok_end if last else 0,
                      last.data_end if last and last.packed else 0)
        self._lock = threading.Lock()  # staging and the committer's record; not its flush round
        self._rounds = threading.Lock()  # one commit round at a time (taken before ``_lock``)
        self._wake = threading.Condition(self._lock)
        #: staged, not yet in a record: (batches, their refs, their future)
        self._queue: list[tuple[list[Marker], list[EntryRef], Future]] = []
        self._last: Future | None = None
        self._failed: BaseException | None = None
        self._committer: threading.Thread | None = None

    def _open_data(self) -> zarr.Array:
        # Zarr writes only the array's metadata; the chunks are written in place (``chunks``)
        group = zarr.open_group(store=self._backend.zarr_store(self.segment, read_only=False), mode="a",
                                zarr_format=3)
        if DATA_ARRAY in set(group.array_keys()):
            return group[DATA_ARRAY]
        arr = group.create_array(DATA_ARRAY, shape=(_FIRST_CHUNKS * DATA_CHUNK,), chunks=(DATA_CHUNK,),
                                 dtype=np.uint8, compressors=None, fill_value=0)
        for key in ("zarr.json", f"{DATA_ARRAY}/zarr.json"):
            self._backend.metadata_changed(self.segment, key)  # durable with the first commit
        return arr

    @property
    def committed(self) -> int:
        """Entries committed in this segment so far (by this writer and its predecessors)."""
        return self._entries

    def write(self, rows: list[StoredSequence]) -> list[EntryRef]:
        """Publish ``rows`` in batches of ``batch_size``; every returned ref is committed."""
        done = self._queue_rows(rows)
        if self._rounds.acquire(blocking=False):  # no round is running: commit here, no thread switch
            try:
                self._commit_round()
            finally:
                self._rounds.release()
        else:
            self._wake_committer()
        return done.result()

    def submit(self, rows: list[StoredSequence]) -> "Future[list[EntryRef]]":
        """Write the bytes of ``rows`` (in batches of ``batch_size``) now and commit them with the
        writer's next flush round; the future's refs are committed (durable when the store is)
        when it resolves. Rows that cannot be stored raise ``ValueError`` here, before anything
        is queued; a failed commit fails its future, every later one and this writer."""
        done = self._queue_rows(rows)
        self._wake_committer()
        return done

    def _queue_rows(self, rows: list[StoredSequence]) -> "Future[list[EntryRef]]":
        """Stage ``rows`` and queue them for the next round (``submit`` without the wake-up)."""
        done: Future[list[EntryRef]] = Future()
        done.set_running_or_notify_cancel()  # the commit happens whoever waits: not cancellable
        with self._lock:
            self._check_open()
            seqno, e, t, b = self._next
            batches: list[Marker] = []
            now = time.time()
            for i in range(0, len(rows), self.batch_size):
                batches.append(self._stage(rows[i:i + self.batch_size], seqno, e, t, b, now))
                seqno, e, t, b = seqno + 1, batches[-1].end, batches[-1].tok_end, batches[-1].data_end
            if not batches:
                done.set_result([])
                return done
            refs = [EntryRef(self.segment, i) for i in range(self._next[1], e)]
            self._next = (seqno, e, t, b)
            self._queue.append((batches, refs, done))
            self._last = done
        return done

    def _wake_committer(self) -> None:
        """Start or wake the committer; none is started once the writer closes (``close``
        commits what is queued itself)."""
        with self._lock:
            if self._committer is None and not self._closed:
                self._committer = threading.Thread(target=self._commit_rounds, daemon=True,
                                                   name=f"commits of {self.segment}")
                self._committer.start()
            self._wake.notify()

    def flush(self) -> None:
        """Wait until everything submitted is committed; raise what failed a commit."""
        with self._lock:
            last = self._last
        if last is not None:
            wait([last])
        with self._lock:
            failed = self._failed
        if failed is not None:
            raise failed  # the first failure (later futures fail for its sake)

    def close(self) -> None:
        """Commit what was submitted, stop the committer and release the segment. Rows are
        queued only while the writer is open, so the last round here (after the committer and
        any ``write`` round) commits what a ``submit`` queued but had not yet woken the
        committer for: nothing queued is committed after the segment is released."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify()
            committer = self._committer
        if committer is not None:
            committer.join()
        with self._rounds:  # a ``write`` committing in another thread finishes first
            self._commit_round()
            self._backend.release_segment(self.segment)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"writer of segment {self.segment!r} is closed: open a new one with store.writer()")
        if self._failed is not None:
            raise RuntimeError(f"writer of segment {self.segment!r} failed to commit ({self._failed}): "
                               "open a new one with store.writer()") from self._failed

    def _commit_rounds(self) -> None:
        """The committer thread: a round whenever something is staged, until the writer closes."""
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    return
            with self._rounds:
                self._commit_round()

    def _commit_round(self) -> None:
        """One log record and one flush round for everything staged so far, then the futures of
        what it committed resolve. Run holding ``_rounds``, so records keep the order of staging.
        Whatever fails it fails its futures and the writer (never the committer thread)."""
        with self._lock:
            work, self._queue = self._queue, []
        if not work:
            return
        try:
            with self._lock:
                if self._failed is not None:
                    raise RuntimeError("an earlier commit of this writer failed") from self._failed
                if self._before_commit is not None:
                    self._before_commit()
                record = log_record([m for batches, _, _ in work for m in batches])
                try:
                    flush_round = self._backend.append_log(self.segment, self._log_end, record)
                except FileExistsError as err:
                    raise SegmentConflict(
                        f"the commit log of segment {self.segment!r} grew past what this writer committed: "
                        "another writer is writing this segment; give every writer its own segment name"
                    ) from err
                self._log_end += len(record)
            flush_round()  # outside the lock: the next batches are staged meanwhile
            with self._lock:
                self._entries = work[-1][0][-1].end
        except BaseException as err:
            with self._lock:
                if self._failed is None:  # later rounds fail for its sake: their records would
                    self._failed = err    # follow one that may not be durable
            for _, _, done in work:
                done.set_exception(err)
            return
        for _, refs, done in work:
            done.set_result(refs)

    def __enter__(self) -> "SegmentWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _grow(self, needed: int) -> None:
        """Over-allocate (capacity starts at ``_FIRST_CHUNKS`` chunks and grows fourfold): resizing
        rewrites the array's metadata and costs a flush, so keep it rare. The shape costs no disk (only written chunks
        exist); readers of this store go by the commits, other Zarr readers by the shape."""
        cap, chunk = self._data.shape[0], self._raw.chunk_rows
        if needed > cap:
            new = -(-max(needed, 4 * cap, _FIRST_CHUNKS * chunk) // chunk) * chunk
            self._data.resize((new,))
            # durable now: a flush round running meanwhile would sync it by path while Zarr replaces it
            self._backend.sync_metadata(self.segment, f"{DATA_ARRAY}/zarr.json")

    def _stage(self, batch: list[StoredSequence], seqno: int, e0: int, t0: int, b0: int, now: float) -> Marker:
        """Write the bytes of ``batch`` (entries from ``e0``, tokens from ``t0``) packed at byte
        ``b0`` of ``data``; what its log record says of it (ranges, where it starts, strings,
        the crc of its bytes). Nothing of it is visible yet."""
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
        tokens = int(lengths.sum())
        at = packed_offsets(n, tokens)
        views = [_bytes_of(data) for data in (*flat.values(), index, rewards)]  # in ``CRC_ORDER``
        self._grow(b0 + at[""])
        if at[""] <= _JOIN_BYTES:  # small: one copy and one write cost less than a write per array
            views = [memoryview(b"".join(views))]
            at = {CRC_ORDER[0]: 0}
        # else each array is written from its own buffer to its place in the batch: no packed copy
        for name, view in zip(CRC_ORDER, views):
            if len(view):
                start = b0 + at[name]
                self._backend.write_chunks(self.segment, self._raw.pieces(start, start + len(view)), view)
        return Marker(seqno, e0, e0 + n, t0, t0 + tokens, strings, now, data_crc(views), BOOT_ID, b0)
