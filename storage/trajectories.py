"""Zarr trajectory store: append-only segments written by RaaS nodes, read by the data layer.

Why it exists: RaaS nodes produce trajectories faster than a scheduler round trip can carry
them, and trainers/the data layer on other nodes need them without copies through Dask. A
store on shared storage, written by many processes and read by a few, with no locking, is
the narrow interface between them.

Layout and commit protocol
--------------------------
Each writer owns one *segment* (a RaaS node writes its own; nobody else writes to it), so no
two processes ever write the same Zarr chunk and nothing relies on Zarr locking (it has none).
A segment (``paths.segment_dir``) is a Zarr v3 group (``paths.segment_data_dir``) holding

* flat per-token arrays ``tokens`` int32, ``loss_mask`` uint8, ``logprobs`` float32,
  ``policy_ids`` int16, ``versions`` int32 (128 KiB chunks, uncompressed);
* per-entry index arrays ``index`` int64 of shape ``(N, 6)`` with the columns of
  ``INDEX_COLUMNS`` (offset into the flat arrays, length, seq_index, num_sequences,
  min_version, max_version) and ``reward`` float64 (float64, not float32: a reward reads
  back exactly as written);
* ``commits/<seqno>.json``: one commit marker per published batch, holding the batch's entry
  range, token range and string columns (task_id, group_id, finish_reason, meta).

Arrays are over-allocated (capacity doubles) and resized only by the segment's writer; the
committed length lives in the markers, never in the array shape. A batch is published in two
steps: (1) the chunk data of the flat and index arrays is written, one concurrent Zarr call per
array (and, when ``durable``, every touched chunk file is fsynced); (2) the commit marker is
created atomically (write temp, fsync, ``os.link`` create-if-absent, fsync the directory).
Readers trust only markers, so an entry whose writer died between (1) and (2) is never
visible, and a restarted writer continues after the last marker, overwriting the orphaned
chunk data.

Overlap invariant (writer vs. readers): a reader may read a chunk while the writer rewrites it
(the last, partly filled chunk is rewritten by the next batch). Zarr's LocalStore replaces a
chunk file atomically (temp + rename), and the rewrite preserves every committed byte, so the
reader sees either version and both hold the committed range it asked for.

Backends: a directory (``/path`` or ``file:///path``; shared filesystem; many processes) and
``memory://<name>`` (in-process registry by name; same semantics within one process; tests and
the embedded default).
"""

from __future__ import annotations

import asyncio
import bisect
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import zarr
from zarr.core.sync import sync as _zarr_sync
from zarr.storage import LocalStore, MemoryStore

from storage import paths

LAYOUT_VERSION = 1

#: per-token arrays and their on-disk dtypes.
FLAT_DTYPES: dict[str, np.dtype] = {
    "tokens": np.dtype(np.int32),
    "loss_mask": np.dtype(np.uint8),
    "logprobs": np.dtype(np.float32),
    "policy_ids": np.dtype(np.int16),
    "versions": np.dtype(np.int32),
}
#: columns of the per-entry ``index`` array (int64).
INDEX_COLUMNS = ("offset", "length", "seq_index", "num_sequences", "min_version", "max_version")
_CHUNK_BYTES = 128 * 1024
_INDEX_CHUNK = 2048  # entries per index chunk: 2048 * 6 * 8 B = 96 KiB
_REWARD_CHUNK = _CHUNK_BYTES // 8
_STRING_COLUMNS = ("task_id", "group_id", "finish_reason", "meta")
#: token gap below which read() fetches one covering slice instead of two.
_MERGE_GAP_TOKENS = 32 * 1024


@dataclass(frozen=True, eq=False)
class StoredSequence:
    """One stored entry: a single token sequence plus the keys the data layer indexes by.

    This is the on-disk schema and knows nothing of RL; ``astraflow.contracts.Trajectory``
    maps to and from it. Per-token arrays all have the same length. Written by a
    ``SegmentWriter`` (RaaS node), returned by ``TrajectoryStore.read`` (data layer, trainer)
    with the on-disk dtypes (``loss_mask`` comes back as uint8).
    """

    task_id: str
    group_id: str
    #: position of this sequence within its trajectory, and how many the trajectory has.
    seq_index: int
    num_sequences: int
    tokens: np.ndarray  # int32
    loss_mask: np.ndarray  # bool or uint8
    logprobs: np.ndarray  # float32
    policy_ids: np.ndarray  # int16
    versions: np.ndarray  # int32
    reward: float
    finish_reason: str
    #: JSON text with everything else (policies, workflow, kind, attempt, provenance, rewards).
    meta: str


@dataclass(frozen=True)
class EntryRef:
    """Where one committed entry lives: segment name and entry index within the segment.
    Returned by ``SegmentWriter.write`` and ``poll``; passed to ``read``. Stable forever."""

    segment: str
    index: int


@dataclass(frozen=True)
class EntryInfo:
    """Index row of a committed entry: enough to route and filter without reading tokens.
    Returned by ``TrajectoryStore.poll`` to the data layer."""

    ref: EntryRef
    task_id: str
    group_id: str
    seq_index: int
    num_sequences: int
    #: number of tokens.
    length: int
    reward: float
    min_version: int  # lowest version among generated tokens (versions >= 0), -1 if none
    max_version: int  # highest such version, -1 if none
    meta: str


Cursor = dict  # segment name -> number of committed entries already seen


class EntryNotCommitted(LookupError):
    """``read`` was asked for an entry that no commit marker covers (yet, or ever)."""


class SegmentConflict(RuntimeError):
    """Two live writers wrote one segment: the commit marker this writer wanted already exists."""


# -- backends: where a store keeps its bytes ---------------------------------------------------

class _Backend(Protocol):
    supports_multiprocess: bool
    durable: bool

    def describe(self) -> str: ...
    def read_layout(self) -> bytes | None: ...
    def create_layout(self, data: bytes) -> None: ...
    def list_segments(self) -> list[str]: ...
    def zarr_store(self, segment: str, read_only: bool) -> Any: ...
    def list_markers(self, segment: str) -> list[int]: ...
    def read_marker(self, segment: str, seqno: int) -> bytes | None: ...
    def publish_marker(self, segment: str, seqno: int, data: bytes) -> None: ...
    def prepare_segment(self, segment: str) -> None: ...
    def sync_chunks(self, segment: str, keys: list[str]) -> None: ...


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_atomically(final: Path, data: bytes, durable: bool = True) -> None:
    """Write ``data`` to a temp file, fsync, and hard-link it to ``final`` only if ``final`` does
    not exist (``FileExistsError`` otherwise). Readers see the whole file or nothing."""
    tmp = paths.tmp_sibling(final)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.link(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        _fsync_dir(final.parent)


class _DirBackend:
    supports_multiprocess = True

    def __init__(self, root: Path, durable: bool):
        self.root = root
        self.durable = durable

    def describe(self) -> str:
        return str(self.root)

    def read_layout(self) -> bytes | None:
        try:
            return paths.store_layout_file(self.root).read_bytes()
        except FileNotFoundError:
            return None

    def create_layout(self, data: bytes) -> None:
        paths.segments_root(self.root).mkdir(parents=True, exist_ok=True)
        try:
            _create_atomically(paths.store_layout_file(self.root), data)
        except FileExistsError:
            pass  # another process created the store first; the caller re-reads and checks it

    def list_segments(self) -> list[str]:
        try:
            names = os.listdir(paths.segments_root(self.root))
        except FileNotFoundError:
            return []
        return sorted(n for n in names if not paths.is_tmp(n) and paths.is_plain_name(n))

    def zarr_store(self, segment: str, read_only: bool) -> Any:
        return LocalStore(paths.segment_data_dir(self.root, segment), read_only=read_only)

    def prepare_segment(self, segment: str) -> None:
        commits = paths.segment_commit_dir(self.root, segment)
        commits.mkdir(parents=True, exist_ok=True)
        for name in os.listdir(commits):  # temp files of a killed writer of this segment
            if paths.is_tmp(name):
                (commits / name).unlink(missing_ok=True)

    def list_markers(self, segment: str) -> list[int]:
        try:
            names = os.listdir(paths.segment_commit_dir(self.root, segment))
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := paths.COMMIT_MARKER_RE.match(n)))

    def read_marker(self, segment: str, seqno: int) -> bytes | None:
        try:
            return paths.commit_marker(self.root, segment, seqno).read_bytes()
        except FileNotFoundError:
            return None

    def publish_marker(self, segment: str, seqno: int, data: bytes) -> None:
        _create_atomically(paths.commit_marker(self.root, segment, seqno), data, self.durable)

    def sync_chunks(self, segment: str, keys: list[str]) -> None:
        if not self.durable:
            return
        base = paths.segment_data_dir(self.root, segment)
        # fdatasync releases the GIL; issuing them together lets the disk overlap the flushes
        list(_sync_pool().map(_fdatasync, [base / key for key in keys]))


def _fdatasync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


_SYNC_POOL: tuple[int, ThreadPoolExecutor] | None = None


def _sync_pool() -> ThreadPoolExecutor:
    """Process-wide fsync threads (recreated in a forked child, which inherits no threads)."""
    global _SYNC_POOL
    if _SYNC_POOL is None or _SYNC_POOL[0] != os.getpid():
        _SYNC_POOL = (os.getpid(), ThreadPoolExecutor(max_workers=8, thread_name_prefix="trajectory-fsync"))
    return _SYNC_POOL[1]


class _MemoryState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.layout: bytes | None = None
        self.zarr: dict[str, dict] = {}
        self.markers: dict[str, dict[int, bytes]] = {}


#: in-process stores by name (``memory://<name>``); lives as long as the process.
_MEMORY_STORES: dict[str, _MemoryState] = {}
_MEMORY_LOCK = threading.Lock()


class _MemoryBackend:
    supports_multiprocess = False
    durable = False

    def __init__(self, name: str, state: _MemoryState):
        self.name = name
        self.state = state

    def describe(self) -> str:
        return f"memory://{self.name}"

    def read_layout(self) -> bytes | None:
        return self.state.layout

    def create_layout(self, data: bytes) -> None:
        with self.state.lock:
            if self.state.layout is None:
                self.state.layout = data

    def list_segments(self) -> list[str]:
        with self.state.lock:
            return sorted(self.state.markers)

    def zarr_store(self, segment: str, read_only: bool) -> Any:
        with self.state.lock:
            d = self.state.zarr.setdefault(segment, {})
        return MemoryStore(store_dict=d, read_only=read_only)

    def prepare_segment(self, segment: str) -> None:
        with self.state.lock:
            self.state.markers.setdefault(segment, {})

    def list_markers(self, segment: str) -> list[int]:
        with self.state.lock:
            return sorted(self.state.markers.get(segment, {}))

    def read_marker(self, segment: str, seqno: int) -> bytes | None:
        with self.state.lock:
            return self.state.markers.get(segment, {}).get(seqno)

    def publish_marker(self, segment: str, seqno: int, data: bytes) -> None:
        with self.state.lock:
            markers = self.state.markers.setdefault(segment, {})
            if seqno in markers:
                raise FileExistsError(f"memory://{self.name} segment {segment} marker {seqno}")
            markers[seqno] = data

    def sync_chunks(self, segment: str, keys: list[str]) -> None:
        return None


def _gather(coros: list) -> list:
    """Run Zarr's async calls concurrently on Zarr's own event loop (one round trip)."""

    async def _all() -> list:
        return await asyncio.gather(*coros)

    return _zarr_sync(_all())


# -- opening a store ---------------------------------------------------------------------------

def open_trajectory_store(url: str, mode: str = "a", *, durable: bool = True) -> "TrajectoryStore":
    """Open (``mode="r"``: must exist) or open-or-create (``mode="a"``) a trajectory store.

    ``url``: a directory path, ``file:///abs/path`` (shared filesystem), or ``memory://<name>``
    (in-process). ``durable`` (directories only): fsync chunk data and markers before a batch
    counts as committed, so a committed entry survives a machine crash, not only a process
    crash. Turning it off trades that for speed on scratch stores.
    """
    if mode not in ("r", "a"):
        raise ValueError(f"mode must be 'r' (existing store, read-only) or 'a' (create if absent), got {mode!r}")
    if not isinstance(url, (str, os.PathLike)):
        raise ValueError(f"store url must be a string path or URL, got {type(url).__name__}")
    url = os.fspath(url)
    backend: _Backend
    if url.startswith("memory://"):
        name = url[len("memory://"):]
        paths.check_name("memory store", name)
        with _MEMORY_LOCK:
            state = _MEMORY_STORES.get(name)
            if state is None and mode == "a":
                state = _MEMORY_STORES[name] = _MemoryState()
        if state is None:
            raise FileNotFoundError(
                f"no in-process trajectory store {url!r}: open it with mode='a' first (memory stores "
                "exist only inside the process that created them)"
            )
        backend = _MemoryBackend(name, state)
    else:
        if "://" in url and not url.startswith("file://"):
            scheme = url.split("://", 1)[0]
            raise ValueError(
                f"unknown trajectory store scheme {scheme!r} in {url!r}: known are a plain directory "
                "path, 'file://', 'memory://'"
            )
        root = Path(url[len("file://"):] if url.startswith("file://") else url).absolute()
        if mode == "a":
            _check_writable_dir(root)
        backend = _DirBackend(root, durable)
    return TrajectoryStore(backend, mode)


def _check_writable_dir(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = paths.tmp_sibling(root / "write-probe")
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(
            f"trajectory store directory {root} is not writable ({e.strerror or e}): point the store "
            "at a directory this process can create files in, or open it with mode='r' to only read"
        ) from e


def _layout_record() -> bytes:
    return json.dumps(
        {"kind": "astraflow-trajectory-store", "layout_version": LAYOUT_VERSION, "created_at": time.time()},
        sort_keys=True,
    ).encode()


# -- the store ---------------------------------------------------------------------------------

@dataclass
class _Marker:
    seqno: int
    start: int  # entry range [start, end)
    end: int
    tok_start: int  # token range [tok_start, tok_end)
    tok_end: int
    strings: dict[str, list[str]]


class _SegmentView:
    """What one store object knows about one segment: its markers (immutable once published)
    and its opened arrays (reopened when the writer grew them past the known shape)."""

    def __init__(self, backend: _Backend, segment: str):
        self.backend = backend
        self.segment = segment
        self.markers: list[_Marker] = []
        self.starts: list[int] = []
        self.loaded = False
        self._arrays: dict[str, zarr.Array] = {}

    @property
    def committed(self) -> int:
        return self.markers[-1].end if self.markers else 0

    def refresh(self) -> None:
        if not self.loaded:
            for seqno in self.backend.list_markers(self.segment):
                if seqno != len(self.markers):
                    break  # markers are gap-free; anything after a gap is not committed yet
                self._add(seqno, self.backend.read_marker(self.segment, seqno))
            self.loaded = True
        while True:
            data = self.backend.read_marker(self.segment, len(self.markers))
            if data is None:
                return
            self._add(len(self.markers), data)

    def _add(self, seqno: int, data: bytes | None) -> None:
        assert data is not None, f"marker {seqno} of {self.segment} vanished"
        rec = json.loads(data)
        m = _Marker(seqno, rec["entries"][0], rec["entries"][1], rec["tokens"][0], rec["tokens"][1],
                    {k: rec[k] for k in _STRING_COLUMNS})
        assert m.start == self.committed, f"segment {self.segment}: marker {seqno} does not continue the last one"
        self.markers.append(m)
        self.starts.append(m.start)

    def marker_of(self, index: int) -> _Marker:
        return self.markers[bisect.bisect_right(self.starts, index) - 1]

    def string(self, column: str, index: int) -> str:
        m = self.marker_of(index)
        return m.strings[column][index - m.start]

    def array(self, name: str, needed: int) -> zarr.Array:
        arr = self._arrays.get(name)
        if arr is None or arr.shape[0] < needed:
            arr = zarr.open_array(store=self.backend.zarr_store(self.segment, read_only=True), path=name, mode="r")
            assert arr.shape[0] >= needed, f"{self.segment}/{name} is shorter than its committed range"
            self._arrays[name] = arr
        return arr


class TrajectoryStore:
    """A trajectory store opened by one process. Not thread-safe; open one per thread."""

    def __init__(self, backend: _Backend, mode: str):
        self._backend = backend
        self._mode = mode
        layout = backend.read_layout()
        if layout is None:
            if mode == "r":
                raise FileNotFoundError(
                    f"no trajectory store at {backend.describe()} (no {paths.store_layout_file(Path('.')).name}): "
                    "check the path, or open it with mode='a' to create one"
                )
            backend.create_layout(_layout_record())
            layout = backend.read_layout()
            assert layout is not None
        rec = json.loads(layout)
        found = rec.get("layout_version")
        if found != LAYOUT_VERSION:
            raise ValueError(
                f"trajectory store at {backend.describe()} has layout version {found}, this code reads "
                f"version {LAYOUT_VERSION}: read it with the AstraFlow version that wrote it, or point "
                "this run at a new store directory"
            )
        self._views: dict[str, _SegmentView] = {}

    @property
    def url(self) -> str:
        return self._backend.describe()

    @property
    def supports_multiprocess(self) -> bool:
        """True when writers and readers in other processes (and nodes) see the same store."""
        return self._backend.supports_multiprocess

    def writer(self, segment: str, batch_size: int = 64) -> "SegmentWriter":
        """The writer of ``segment`` (created if absent). One live writer per segment: a second
        one is detected only when both publish the same marker (``SegmentConflict``)."""
        if self._mode == "r":
            raise ValueError(f"store {self.url} was opened with mode='r': open it with mode='a' to write")
        paths.check_name("segment", segment)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return SegmentWriter(self._backend, segment, batch_size)

    def segments(self) -> list[str]:
        return self._backend.list_segments()

    def _view(self, segment: str) -> _SegmentView:
        v = self._views.get(segment)
        if v is None:
            v = self._views[segment] = _SegmentView(self._backend, paths.check_name("segment", segment))
        return v

    def poll(self, cursor: Cursor | None = None) -> tuple[list[EntryInfo], Cursor]:
        """Committed entries not yet covered by ``cursor``, across all segments, in segment then
        entry order, and the cursor that covers them. The cursor is a plain JSON-able dict."""
        cursor = dict(cursor or {})
        for seg, seen in cursor.items():
            if not isinstance(seg, str) or not isinstance(seen, int) or seen < 0:
                raise ValueError(f"cursor must map segment names to entry counts >= 0, got {seg!r}: {seen!r}")
        new_cursor = dict(cursor)
        todo: list[tuple[_SegmentView, int, int]] = []
        for seg in self.segments():
            view = self._view(seg)
            view.refresh()
            seen, end = cursor.get(seg, 0), view.committed
            if seen > end:
                raise ValueError(
                    f"cursor says {seen} entries of segment {seg!r} were seen but {self.url} has only {end} "
                    "committed: the cursor belongs to another store; start from an empty cursor"
                )
            new_cursor[seg] = end
            if end > seen:
                todo.append((view, seen, end))
        coros = []
        for view, a, b in todo:
            coros.append(view.array("index", b).async_array.getitem(slice(a, b)))
            coros.append(view.array("reward", b).async_array.getitem(slice(a, b)))
        got = _gather(coros) if coros else []
        infos: list[EntryInfo] = []
        for k, (view, a, b) in enumerate(todo):
            index, reward = got[2 * k], got[2 * k + 1]
            for i in range(a, b):
                m = view.marker_of(i)
                j = i - m.start
                row = index[i - a]
                infos.append(
                    EntryInfo(
                        ref=EntryRef(view.segment, i),
                        task_id=m.strings["task_id"][j],
                        group_id=m.strings["group_id"][j],
                        seq_index=int(row[2]),
                        num_sequences=int(row[3]),
                        length=int(row[1]),
                        reward=float(reward[i - a]),
                        min_version=int(row[4]),
                        max_version=int(row[5]),
                        meta=m.strings["meta"][j],
                    )
                )
        return infos, new_cursor

    def read(self, refs: list[EntryRef]) -> list[StoredSequence]:
        """The entries ``refs`` name, in that order, exactly as written (batched: one Zarr call
        per array per run of nearby entries). ``EntryNotCommitted`` for an uncommitted ref."""
        by_seg: dict[str, list[int]] = {}
        for pos, ref in enumerate(refs):
            by_seg.setdefault(ref.segment, []).append(pos)
        out: list[StoredSequence | None] = [None] * len(refs)
        # 1) index rows of the requested entries (one covering slice per segment)
        plans = []
        for seg, positions in by_seg.items():
            view = self._view(seg)
            idx = [refs[p].index for p in positions]
            if max(idx) >= view.committed:
                view.refresh()
            bad = [i for i in idx if i < 0 or i >= view.committed]
            if bad:
                raise EntryNotCommitted(
                    f"segment {seg!r} of {self.url} has {view.committed} committed entries; "
                    f"asked for {bad[:5]}: pass only refs returned by poll() or write()"
                )
            plans.append((view, positions, idx, min(idx), max(idx) + 1))
        got = _gather([
            c
            for view, _, _, a, b in plans
            for c in (view.array("index", b).async_array.getitem(slice(a, b)),
                      view.array("reward", b).async_array.getitem(slice(a, b)))
        ]) if plans else []
        # 2) token runs: sorted by offset, merged when close, one slice per array per run
        run_jobs = []  # (view, t0, t1, [(pos, entry_index, offset, length, index_row, reward)])
        for k, (view, positions, idx, a, _) in enumerate(plans):
            index, reward = got[2 * k], got[2 * k + 1]
            items = sorted(
                ((p, i, int(index[i - a][0]), int(index[i - a][1]), index[i - a], float(reward[i - a]))
                 for p, i in zip(positions, idx)),
                key=lambda t: t[2],
            )
            cur: list = []
            t0 = t1 = 0
            for it in items:
                if cur and it[2] - t1 > _MERGE_GAP_TOKENS:
                    run_jobs.append((view, t0, t1, cur))
                    cur = []
                if not cur:
                    t0 = it[2]
                    t1 = it[2]
                cur.append(it)
                t1 = max(t1, it[2] + it[3])
            if cur:
                run_jobs.append((view, t0, t1, cur))
        coros = [
            view.array(name, t1).async_array.getitem(slice(t0, t1))
            for view, t0, t1, _ in run_jobs
            for name in FLAT_DTYPES
        ]
        flat = _gather(coros) if coros else []
        names = list(FLAT_DTYPES)
        for r, (view, t0, _, items) in enumerate(run_jobs):
            arrays = dict(zip(names, flat[r * len(names):(r + 1) * len(names)]))
            for pos, i, off, length, row, rew in items:
                s = slice(off - t0, off - t0 + length)
                m = view.marker_of(i)
                j = i - m.start
                out[pos] = StoredSequence(
                    task_id=m.strings["task_id"][j],
                    group_id=m.strings["group_id"][j],
                    seq_index=int(row[2]),
                    num_sequences=int(row[3]),
                    tokens=arrays["tokens"][s].copy(),
                    loss_mask=arrays["loss_mask"][s].copy(),
                    logprobs=arrays["logprobs"][s].copy(),
                    policy_ids=arrays["policy_ids"][s].copy(),
                    versions=arrays["versions"][s].copy(),
                    reward=rew,
                    finish_reason=m.strings["finish_reason"][j],
                    meta=m.strings["meta"][j],
                )
        return out  # type: ignore[return-value]

    def count(self, segment: str) -> int:
        """Committed entries of ``segment`` (0 for an unknown one)."""
        view = self._view(segment)
        view.refresh()
        return view.committed


def _flat_chunk(name: str) -> int:
    return _CHUNK_BYTES // FLAT_DTYPES[name].itemsize


def _chunk_keys(name: str, chunk: int, a: int, b: int, suffix: str = "") -> list[str]:
    if b <= a:
        return []
    return [f"{name}/c/{c}{suffix}" for c in range(a // chunk, (b - 1) // chunk + 1)]


class SegmentWriter:
    """Appends entries to one segment. The only process that writes (or resizes) its arrays."""

    #: test hook: called after a batch's chunk data is written and before its marker exists.
    _before_commit: Callable[[], None] | None = None

    def __init__(self, backend: _Backend, segment: str, batch_size: int):
        self._backend = backend
        self.segment = segment
        self.batch_size = batch_size
        self._closed = False
        backend.prepare_segment(segment)
        self._arrays = self._open_arrays()
        # continue after the last committed marker (uncommitted chunk data is overwritten)
        view = _SegmentView(backend, segment)
        view.refresh()
        last = view.markers[-1] if view.markers else None
        self._seqno = len(view.markers)
        self._entries = last.end if last else 0
        self._tokens = last.tok_end if last else 0

    def _open_arrays(self) -> dict[str, zarr.Array]:
        # chunks equal to the fill value are still written: every touched chunk file exists
        # (fsync needs it) and orphaned data of a killed writer is always overwritten.
        with zarr.config.set({"array.write_empty_chunks": True}):
            group = zarr.open_group(store=self._backend.zarr_store(self.segment, read_only=False), mode="a")
            existing = set(group.array_keys())
            arrays: dict[str, zarr.Array] = {}
            for name, dt in FLAT_DTYPES.items():
                arrays[name] = group[name] if name in existing else group.create_array(
                    name, shape=(0,), chunks=(_flat_chunk(name),), dtype=dt, compressors=None, fill_value=0)
            arrays["index"] = group["index"] if "index" in existing else group.create_array(
                "index", shape=(0, len(INDEX_COLUMNS)), chunks=(_INDEX_CHUNK, len(INDEX_COLUMNS)),
                dtype=np.int64, compressors=None, fill_value=0)
            arrays["reward"] = group["reward"] if "reward" in existing else group.create_array(
                "reward", shape=(0,), chunks=(_REWARD_CHUNK,), dtype=np.float64, compressors=None, fill_value=0.0)
        for arr in arrays.values():
            assert arr.config.write_empty_chunks
        return arrays

    @property
    def committed(self) -> int:
        """Entries committed in this segment so far (by this writer and its predecessors)."""
        return self._entries

    def write(self, rows: list[StoredSequence]) -> list[EntryRef]:
        """Publish ``rows`` in batches of ``batch_size``; every returned ref is committed."""
        if self._closed:
            raise ValueError(f"writer of segment {self.segment!r} is closed: open a new one with store.writer()")
        refs: list[EntryRef] = []
        for i in range(0, len(rows), self.batch_size):
            refs.extend(self._publish(rows[i:i + self.batch_size]))
        return refs

    def flush(self) -> None:
        """Nothing is buffered between calls: ``write`` publishes what it was given."""
        return None

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> "SegmentWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _grow(self, name: str, needed: int, chunk: int) -> None:
        """Over-allocate (capacity doubles): resizing rewrites array metadata, so keep it rare."""
        arr = self._arrays[name]
        cap = arr.shape[0]
        if needed > cap:
            new = -(-max(needed, 2 * cap, chunk) // chunk) * chunk
            arr.resize((new,) + tuple(arr.shape[1:]))

    def _publish(self, batch: list[StoredSequence]) -> list[EntryRef]:
        if not batch:
            return []
        n = len(batch)
        lengths = np.empty(n, dtype=np.int64)
        cols: dict[str, list[np.ndarray]] = {k: [] for k in FLAT_DTYPES}
        for r, row in enumerate(batch):
            length = len(row.tokens)
            for k in FLAT_DTYPES:
                a = np.asarray(getattr(row, k))
                if a.ndim != 1 or len(a) != length:
                    raise ValueError(
                        f"entry {row.task_id!r}: {k} has shape {a.shape} but tokens has {length} entries; "
                        "every per-token array must be 1-D with one value per token"
                    )
                cols[k].append(a)
            lengths[r] = length
        flat = {}
        for k, dt in FLAT_DTYPES.items():
            cat = np.concatenate(cols[k]) if lengths.sum() else np.zeros(0, dt)
            cast = cat.astype(dt, copy=False)
            if cat.dtype != dt and not np.array_equal(cast, cat, equal_nan=cat.dtype.kind in "fc"):
                raise ValueError(f"{k} values do not fit the stored dtype {dt}: cast them before writing")
            flat[k] = cast
        offsets = self._tokens + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        index = np.empty((n, len(INDEX_COLUMNS)), dtype=np.int64)
        index[:, 0] = offsets
        index[:, 1] = lengths
        index[:, 2] = [r.seq_index for r in batch]
        index[:, 3] = [r.num_sequences for r in batch]
        for r, row in enumerate(batch):
            v = flat["versions"][offsets[r] - self._tokens: offsets[r] - self._tokens + lengths[r]]
            gen = v[v >= 0]
            index[r, 4] = gen.min() if len(gen) else -1
            index[r, 5] = gen.max() if len(gen) else -1
        rewards = np.array([float(r.reward) for r in batch], dtype=np.float64)
        strings = {c: [getattr(r, c) for r in batch] for c in _STRING_COLUMNS}
        for c, vals in strings.items():
            bad = [v for v in vals if not isinstance(v, str)]
            if bad:
                raise ValueError(f"StoredSequence.{c} must be str, got {type(bad[0]).__name__}")
        t0, t1 = self._tokens, self._tokens + int(lengths.sum())
        e0, e1 = self._entries, self._entries + n
        for k in FLAT_DTYPES:
            self._grow(k, t1, _flat_chunk(k))
        self._grow("index", e1, _INDEX_CHUNK)
        self._grow("reward", e1, _REWARD_CHUNK)
        writes = [self._arrays[k].async_array.setitem(slice(t0, t1), flat[k]) for k in FLAT_DTYPES if t1 > t0]
        writes.append(self._arrays["index"].async_array.setitem(slice(e0, e1), index))
        writes.append(self._arrays["reward"].async_array.setitem(slice(e0, e1), rewards))
        _gather(writes)
        keys = [key for k in FLAT_DTYPES for key in _chunk_keys(k, _flat_chunk(k), t0, t1)]
        keys += _chunk_keys("index", _INDEX_CHUNK, e0, e1, "/0") + _chunk_keys("reward", _REWARD_CHUNK, e0, e1)
        self._backend.sync_chunks(self.segment, keys)
        if self._before_commit is not None:
            self._before_commit()
        marker = {"seqno": self._seqno, "entries": [e0, e1], "tokens": [t0, t1], "written_at": time.time(),
                  **strings}
        try:
            self._backend.publish_marker(self.segment, self._seqno, json.dumps(marker).encode())
        except FileExistsError as e:
            raise SegmentConflict(
                f"commit marker {self._seqno} of segment {self.segment!r} already exists: another writer is "
                "writing this segment; give every writer its own segment name"
            ) from e
        self._seqno += 1
        self._entries, self._tokens = e1, t1
        return [EntryRef(self.segment, i) for i in range(e0, e1)]
