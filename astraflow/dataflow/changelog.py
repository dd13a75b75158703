"""The data layer's change log: a base snapshot and an append-only log of changed entries.

Files, next to the snapshot path ``P`` (``control/dataflow.snapshot``):

* ``P``, the base: every entry (``changes.py``) pickled on its own, the small fields, the
  number ``seq`` of the last record it includes and the number ``log`` of the first log file
  to replay after it. Written atomically and fsynced.
* ``<stem>.changes.<n>``: records ``seq + 1, seq + 2, ...``, each ``[length][crc32][pickle]``
  of ``{"seq", "small", "set": [(kind, key, entry pickle or None for a removed entry)]}``.

A commit writes one record of the entries marked since the previous one (its cost follows
what changed, not what the layer holds) to the kernel, on the event loop, and answers the
calls that awaited it; calls that commit in the same turn of the loop share it. Each entry's
latest pickle is also kept in memory (the shadow), so that compaction writes a new base
without capturing the layer: when the log outgrows the base, the next records go to a new
log file, and a thread writes the shadow as the base (then the older log files are removed).
Restore reads the base and replays the records after it in order, up to the first torn or
missing one (a crash in the middle of an append leaves the records before it whole). Every
pickle is read with ``AllowlistUnpickler``: a forged file is refused without running code.
"""

from __future__ import annotations

import asyncio
import copyreg
import io
import logging
import os
import pickle
import struct
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from astraflow.contracts import RolloutTask, SequenceSummary, TrajectoryRef
from astraflow.dataflow import changes
from astraflow.dataflow.buffers import Item, ReadyGroup, RolloutGroup
from astraflow.dataflow.evals import EvalRound
from astraflow.dataflow.ledger import TaskRecord
from astraflow.dataflow.record import Generated
from storage.atomic import sync_together, write_atomically
from storage.trajectories.layout import EntryRef
from storage.safe_pickle import AllowlistUnpickler

if TYPE_CHECKING:
    from astraflow.dataflow.layer import DataLayer

log = logging.getLogger("astraflow.dataflow")

FORMAT = changes.FORMAT
#: a base of an earlier AstraFlow: the whole state in one pickle, no log
WHOLE_FORMAT = 1
#: what an entry may refer to: the data layer's records, and numpy scalars/arrays in payloads
SNAPSHOT_GLOBALS: dict[str, frozenset[str]] = {
    "astraflow.contracts": frozenset({"RolloutTask", "TrajectoryRef", "SequenceSummary"}),
    "storage.trajectories.layout": frozenset({"EntryRef"}),
    "astraflow.dataflow.ledger": frozenset({"TaskRecord"}),
    "astraflow.dataflow.buffers": frozenset({"RolloutGroup", "Item", "ReadyGroup"}),
    "astraflow.dataflow.evals": frozenset({"EvalRound"}),
    "astraflow.dataflow.record": frozenset({"Generated"}),
    "collections": frozenset({"Counter", "deque", "OrderedDict"}),
    "numpy": frozenset({"dtype", "ndarray"}),
    "numpy.core.multiarray": frozenset({"scalar", "_reconstruct"}),
    "numpy._core.multiarray": frozenset({"scalar", "_reconstruct"}),
}
HEADER = struct.Struct("<II")  # payload length, crc32 of the payload
#: the log is compacted once it is this long and longer than twice the base
COMPACT_MIN_BYTES = 8 << 20


class UnusableSnapshot(ValueError):
    """The snapshot cannot be restored (unreadable, forged, or of another configuration)."""


#: the data layer's record classes: plain dataclasses, their state their ``__dict__``
RECORD_CLASSES = (RolloutTask, TrajectoryRef, SequenceSummary, EntryRef, TaskRecord, RolloutGroup, Item,
                  ReadyGroup, EvalRound, Generated)


def _reduce_record(obj: Any) -> tuple:
    return copyreg.__newobj__, (type(obj),), obj.__dict__


class _Pickler(pickle.Pickler):
    """Writes the record classes as the default protocol does (the same bytes: class, then
    its ``__dict__``), without the default's generic look-ups per instance."""

    dispatch_table = {cls: _reduce_record for cls in RECORD_CLASSES}


def _dumps(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


#: a value pickled to more bytes than this is followed by a new pickler rather than a cleared memo
_BIG_PICKLE = 4 << 10


def _dumps_each(values: list[Any]) -> list[bytes]:
    """Each value pickled on its own (``pickle.dumps``'s bytes), by one pickler: the values
    go into one buffer, the memo cleared after each (no value refers to another), and the
    buffer is cut at their ends. Clearing costs the memo table's size, which only grows: after
    a big value (a served batch's items) a fresh pickler goes on."""
    out = io.BytesIO()
    pickler = _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
    ends = [0]
    for value in values:
        pickler.dump(value)
        ends.append(out.tell())
        if ends[-1] - ends[-2] > _BIG_PICKLE:  # its memo table grew, and clearing it costs its size
            pickler = _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
        else:
            pickler.clear_memo()
    del ends[0]
    data, start, blobs = out.getbuffer(), 0, []
    for end in ends:
        blobs.append(bytes(data[start:end]))
        start = end
    data.release()
    return blobs


def _loads(data: bytes, source: Path, allowed: dict[str, frozenset[str]] = SNAPSHOT_GLOBALS) -> Any:
    return AllowlistUnpickler(data, source, allowed).load()


def log_path(path: Path, number: int) -> Path:
    return path.with_name(f"{path.stem}.changes.{number}")


def log_numbers(path: Path) -> list[int]:
    """The numbers of the log files of the base ``path``, ascending."""
    prefix = f"{path.stem}.changes."
    out = []
    for p in path.parent.glob(prefix + "*") if path.parent.is_dir() else ():
        tail = p.name[len(prefix):]
        if tail.isdigit():
            out.append(int(tail))
    return sorted(out)


def read_records(path: Path) -> tuple[list[bytes], bool]:
    """The whole records of a log file, and whether it ends with a torn one (a crash during
    its last write: the bad record reaches the end of the file). A bad record with data after
    it is damage, not a torn write: ``UnusableSnapshot`` naming the file and the offset (the
    records after it must not be dropped silently)."""
    data = path.read_bytes()
    out, pos = [], 0
    while pos + HEADER.size <= len(data):
        size, crc = HEADER.unpack_from(data, pos)
        end = pos + HEADER.size + size
        payload = data[pos + HEADER.size:end]
        if end > len(data) or zlib.crc32(payload) != crc:
            if _whole_record_at(data, end):
                raise UnusableSnapshot(f"{path}: the record at byte {pos} is damaged and whole records follow "
                                       "it (not a write cut short by a crash)")
            return out, True
        out.append(payload)
        pos = end
    return out, pos != len(data)


def _whole_record_at(data: bytes, pos: int) -> bool:
    """Whether a whole record (its CRC right) starts at ``pos`` of ``data``."""
    if pos + HEADER.size > len(data):
        return False
    size, crc = HEADER.unpack_from(data, pos)
    end = pos + HEADER.size + size
    return size > 0 and end <= len(data) and zlib.crc32(data[pos + HEADER.size:end]) == crc


def load(path: Path) -> dict[str, Any] | None:
    """The state saved at ``path`` (base and log replayed, ``changes.assemble``'s form; None
    when there is none); ``UnusableSnapshot`` when it cannot be read or refers to anything but
    the data layer's records."""
    if not path.exists():
        return None
    try:
        base = _loads(path.read_bytes(), path)
        if isinstance(base, dict) and base.get("format") == WHOLE_FORMAT:
            return base
        if not isinstance(base, dict) or base.get("format") not in changes.READABLE:
            raise UnusableSnapshot(f"{path} is not a data-layer snapshot of this AstraFlow version")
        entries = {kind: {key: _loads(blob, path) for key, blob in found.items()}
                   for kind, found in base["entries"].items()}
        small, seq = _loads(base["small"], path), base["seq"]
        numbers = [n for n in log_numbers(path) if n >= base["log"]]
        for number in numbers:
            source = log_path(path, number)
            records, torn = read_records(source)
            later = [log_path(path, n) for n in numbers if n > number]
            if torn and any(f.stat().st_size for f in later):  # records follow: not a write cut by a crash
                raise UnusableSnapshot(f"{source} ends with a damaged record, and a later log file holds records")
            for payload in records:
                rec = _loads(payload, source, {})
                if rec["seq"] <= seq:
                    continue
                if rec["seq"] != seq + 1:  # a record is missing: what follows cannot be applied
                    torn = True
                    break
                for kind, key, blob in rec["set"]:
                    if blob is None:
                        entries[kind].pop(key, None)
                    else:
                        entries[kind][key] = _loads(blob, source)
                small, seq = _loads(rec["small"], source), seq + 1
            if torn:
                break
    except UnusableSnapshot:
        raise
    except Exception as err:
        raise UnusableSnapshot(f"{path} cannot be read ({type(err).__name__}: {err})") from None
    return changes.assemble(base["fingerprint"], small, entries)


class ChangeLog:
    """The group commit of the data layer's records (module docstring). ``path`` None: nothing
    is saved. ``start`` once the layer is built and restored; then ``await commit()``."""

    def __init__(self, path: Path | None, fingerprint: str):
        self.path = path
        self.fingerprint = fingerprint
        self._dl: DataLayer | None = None
        self._lengths: Callable[[], dict[str, int]] = dict
        self._marks: changes.Marks | None = None
        self._shadow: dict[str, dict[Any, bytes]] = {k: {} for k in changes.KINDS}
        self._small = b""
        self._seq = 0
        self._fd: int | None = None
        self._log_no = 0
        self._log_bytes = 0
        self._dir_synced = False
        self._waiters: list[asyncio.Future] = []
        self._sync = False
        self._scheduled = False
        self._broken: BaseException | None = None
        self._tasks: set[asyncio.Task] = set()
        self._compaction: asyncio.Task | None = None
        self.writes = self.commits = self.entries = self.compactions = 0
        self.write_s = 0.0
        self.bytes = self.log_bytes = self.base_bytes = 0

    def stats(self) -> dict[str, Any]:
        return {"writes": self.writes, "commits": self.commits, "write_s": round(self.write_s, 3),
                "last_bytes": self.bytes, "entries": self.entries, "log_bytes": self.log_bytes,
                "base_bytes": self.base_bytes, "compactions": self.compactions}

    # -- start -----------------------------------------------------------------------------
    def start(self, dl: DataLayer, lengths: Callable[[], dict[str, int]]) -> None:
        """Everything ``dl`` holds now becomes the base (fsynced, in the constructor, before any
        call), the log starts afresh and the older log files are removed."""
        if self.path is None:
            return
        self._dl, self._lengths = dl, lengths
        self._marks = changes.Marks(dl)
        found = [(kind, key, changes.entry(dl, kind, key)) for kind, key in changes.all_keys(dl)]
        found = [(kind, key, value) for kind, key, value in found if value is not None]
        for (kind, key, _), blob in zip(found, _dumps_each([value for _, _, value in found])):
            self._shadow[kind][key] = blob
        self._small = _dumps(changes.small(dl, lengths()))
        older = log_numbers(self.path)
        self._log_no = max(older, default=0) + 1
        self._open_log()
        data = self._base(self._shadow, self._small, self._seq, self._log_no)
        write_atomically(self.path, data, True)
        self.base_bytes = len(data)
        for n in older:
            log_path(self.path, n).unlink(missing_ok=True)

    def _open_log(self) -> None:
        path = log_path(self.path, self._log_no)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self._log_bytes, self._dir_synced = 0, False

    def _base(self, shadow: dict[str, dict[Any, bytes]], small: bytes, seq: int, log_no: int) -> bytes:
        return _dumps({"format": FORMAT, "fingerprint": self.fingerprint, "seq": seq, "log": log_no,
                       "small": small, "entries": shadow})

    def fail(self, err: BaseException) -> None:
        """The state changed in a way no record may hold (a call stopped half way): every
        commit from now on raises ``err``, so what the log holds stays the last whole state."""
        if self._broken is None:
            self._broken = err

    # -- commit ----------------------------------------------------------------------------
    async def commit(self, sync: bool = False) -> None:
        """Return once a record holding every change made before the call is written (and,
        with ``sync``, fsynced)."""
        if self.path is None or self._marks is None:
            return
        if self._broken is not None:
            raise self._broken
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiters.append(fut)
        self.commits += 1
        self._sync = self._sync or sync
        if not self._scheduled:  # the calls of this turn of the loop join this record
            self._scheduled = True
            loop.call_soon(self._flush)
        await fut

    def _flush(self) -> None:
        if not self._scheduled:  # written by ``close`` already
            return
        self._scheduled = False
        waiters, self._waiters = self._waiters, []
        sync, self._sync = self._sync, False
        if self._marks is None or self._fd is None:
            _fail(waiters, RuntimeError("the data layer's change log is closed"))
            return
        t0 = time.perf_counter()
        keys = self._marks.take()
        try:
            self._append(keys)
        except Exception as err:  # e.g. disk full: every waiting call fails with it
            self._marks.give_back(keys)
            _fail(waiters, err)
            return
        self.write_s += time.perf_counter() - t0
        if sync:
            self._spawn(self._synced(waiters))
        else:
            _resolve(waiters)
        if self._compaction is None and self._log_bytes > max(COMPACT_MIN_BYTES, 2 * self.base_bytes):
            self._compaction = self._spawn(self._compact())

    def _append(self, keys: set[tuple[str, Any]]) -> None:
        dl, shadow, entry = self._dl, self._shadow, changes.entry
        present, values, removed = [], [], []
        for kind, key in keys:
            value = entry(dl, kind, key)
            if value is not None:
                present.append((kind, key))
                values.append(value)
            elif key in shadow[kind]:
                removed.append((kind, key, None))
        changed = [(kind, key, blob) for (kind, key), blob in zip(present, _dumps_each(values))] + removed
        small = _dumps(changes.small(dl, self._lengths()))
        payload = _dumps({"seq": self._seq + 1, "small": small, "set": changed})
        frame = HEADER.pack(len(payload), zlib.crc32(payload)) + payload
        try:
            view = memoryview(frame)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError:
            try:  # no torn record may stay in front of the next one
                os.ftruncate(self._fd, self._log_bytes)
            except OSError as err:
                self._broken = err
            raise
        self._seq += 1
        for kind, key, blob in changed:
            if blob is None:
                del shadow[kind][key]
            else:
                shadow[kind][key] = blob
        self._small = small
        self._log_bytes += len(frame)
        self.writes += 1
        self.entries += len(changed)
        self.bytes = len(frame)
        self.log_bytes += len(frame)

    async def _synced(self, waiters: list[asyncio.Future]) -> None:
        if self._fd is None:
            _fail(waiters, RuntimeError("the data layer's change log is closed"))
            return
        # a compaction may close the log meanwhile, and open a new one: the directory fsync
        # covers the log file of this generation, not one created while it runs
        fd, log_no = os.dup(self._fd), self._log_no
        try:
            await asyncio.to_thread(sync_together, [fd], [] if self._dir_synced else [self.path.parent])
            if self._log_no == log_no:
                self._dir_synced = True
        except Exception as err:
            _fail(waiters, err)
            return
        finally:
            os.close(fd)
        _resolve(waiters)

    async def _compact(self) -> None:
        """The next records go to a new log file; the shadow, as of the last record, becomes
        the base in a thread; then the older log files are removed."""
        try:
            old = self._fd
            self._log_no += 1
            self._open_log()
            os.close(old)
            shadow = {kind: dict(found) for kind, found in self._shadow.items()}  # references only
            data = await asyncio.to_thread(self._base, shadow, self._small, self._seq, self._log_no)
            await asyncio.to_thread(write_atomically, self.path, data, True)
            self.base_bytes = len(data)
            for n in log_numbers(self.path):
                if n < self._log_no:
                    log_path(self.path, n).unlink(missing_ok=True)
            self.compactions += 1
        except Exception:  # the base and log files before it still hold everything
            log.exception("compacting the data layer's change log failed (retried later)")
        finally:
            self._compaction = None

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        """Write what is pending, wait for syncs and a compaction, close the log; later commits
        write nothing. Commits made while it waits are written and waited for too, until none
        is scheduled or in flight."""
        while self._scheduled or self._tasks:
            if self._scheduled:
                self._flush()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
        self._marks = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _resolve(waiters: list[asyncio.Future]) -> None:
    for w in waiters:
        if not w.done():
            w.set_result(None)


def _fail(waiters: list[asyncio.Future], err: BaseException) -> None:
    for w in waiters:
        if not w.done():
            w.set_exception(err)
