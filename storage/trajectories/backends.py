"""Trajectory store, backends room: where a store keeps its bytes.

Why it exists: the writer and the reader speak to one small protocol (``StoreBackend``), and
two implementations answer it: a directory on a shared filesystem (many processes; a commit
log per segment, appended and made durable with the chunk data in one flush round; here) and
an in-process registry by name (``memory://<name>``, for tests and benchmarks: a run refuses
it; ``memory``). ``open_backend`` picks one from a URL (what the URL names and whether a run
can keep a store there: ``locations``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable, Protocol

from zarr.storage import LocalStore

from storage import paths
from storage.atomic import create_atomically, fsync_path, sync_together, write_atomically
from storage.full_disk import named
from storage.ownership import check_store_dir
from storage.trajectories.chunks import Piece
from storage.trajectories.locations import check_writable_dir, file_url_path
from storage.trajectories.memory import open_memory_backend


class StoreBackend(Protocol):
    """What the store needs from where its bytes live. ``write_chunks``/``read_chunks`` move byte
    ranges of chunks (``chunks.Piece``: key, chunk size, offset, length, offset in ``buf``) in
    place; a chunk never written reads as zeros. ``append_log`` appends a record to the
    segment's commit log at ``offset`` (``FileExistsError`` when the log is not that long:
    another writer appended) after everything ``write_chunks`` and ``metadata_changed``
    touched, and returns the flush round that makes all of it durable (a no-op when not
    durable); the round may run while the segment's next chunks are written, but calls for one
    segment must not overlap each other. ``read_log``: the log's bytes from ``offset``, ``size``
    of them when it is not negative (``b""`` if absent). ``sync_metadata``: a metadata file just
    replaced is made durable now. ``prepare_segment``: the writer of a segment starts, its log's valid records end at
    ``log_end`` (what follows is cut off). Commit markers (``list_markers``/``read_marker``) are read only: segments
    written before the commit log have them. ``release_segment``: the segment's writer is
    closed (files kept open for it may close). ``read_metadata``: a segment's Zarr metadata
    file (``<array>/zarr.json``), ``None`` if absent."""

    #: writers and readers in other processes (and nodes) see the same store.
    supports_multiprocess: bool
    #: chunk data and markers are fsynced before a batch counts as committed.
    durable: bool

    def describe(self) -> str: ...
    def read_layout(self) -> bytes | None: ...
    def create_layout(self, data: bytes) -> None: ...
    def replace_layout(self, data: bytes) -> None: ...
    def list_segments(self) -> list[str]: ...
    def zarr_store(self, segment: str, read_only: bool) -> Any: ...
    def list_markers(self, segment: str) -> list[int]: ...
    def read_marker(self, segment: str, seqno: int) -> bytes | None: ...
    def read_log(self, segment: str, offset: int, size: int = -1) -> bytes: ...
    def append_log(self, segment: str, offset: int, record: bytes) -> Callable[[], None]: ...
    def prepare_segment(self, segment: str, log_end: int) -> None: ...
    def write_chunks(self, segment: str, pieces: list[Piece], buf: memoryview) -> None: ...
    def read_chunks(self, segment: str, pieces: list[Piece], buf: memoryview) -> None: ...
    def metadata_changed(self, segment: str, key: str) -> None: ...
    def sync_metadata(self, segment: str, key: str) -> None: ...
    def release_segment(self, segment: str) -> None: ...
    def delete_segment(self, segment: str) -> None: ...
    def read_metadata(self, segment: str, key: str) -> bytes | None: ...


class DirBackend:
    """A directory (``paths.segments_root`` and friends), shared by many processes."""

    supports_multiprocess = True

    def __init__(self, root: Path, durable: bool):
        self.root = root
        self.durable = durable
        # per segment: files written and directories changed since its last marker
        self._unsynced: dict[str, tuple[dict[str, None], set[Path]]] = {}
        # per segment: chunk files open for writing (checked to have their full size), kept open
        # across commits when durable (a chunk takes many batches); the oldest closed beyond
        # ``_MAX_OPEN``. Per segment because the writers of one store may write at the same time
        # from several threads, each to its own segment: one's eviction must never close a
        # descriptor another is writing or syncing (its number could be reused by a new file).
        self._open: dict[str, dict[str, int]] = {}
        self._logs: dict[str, int] = {}  # commit logs open for appending (durable), by segment
        self._data_dirs: dict[str, str] = {}

    def describe(self) -> str:
        return str(self.root)

    def _data_dir(self, segment: str) -> str:
        d = self._data_dirs.get(segment)
        if d is None:
            d = self._data_dirs[segment] = str(paths.segment_data_dir(self.root, segment))
        return d

    def read_layout(self) -> bytes | None:
        try:
            return paths.store_layout_file(self.root).read_bytes()
        except FileNotFoundError:
            return None

    def create_layout(self, data: bytes) -> None:
        paths.segments_root(self.root).mkdir(parents=True, exist_ok=True)
        try:
            create_atomically(paths.store_layout_file(self.root), data)
        except FileExistsError:
            pass  # another process created the store first; the caller re-reads and checks it

    def replace_layout(self, data: bytes) -> None:
        write_atomically(paths.store_layout_file(self.root), data)

    def list_segments(self) -> list[str]:
        try:
            names = os.listdir(paths.segments_root(self.root))
        except FileNotFoundError:
            return []
        return sorted(n for n in names if not paths.is_tmp(n) and paths.is_plain_name(n))

    def zarr_store(self, segment: str, read_only: bool) -> Any:
        return LocalStore(paths.segment_data_dir(self.root, segment), read_only=read_only)

    def prepare_segment(self, segment: str, log_end: int) -> None:
        commits = paths.segment_commit_dir(self.root, segment)
        dirs = self._unsynced.setdefault(segment, ({}, set()))[1]
        if not commits.is_dir():  # a new segment: its directory entries become durable with its first commit
            dirs.update({paths.segments_root(self.root), paths.segment_dir(self.root, segment)})
        commits.mkdir(parents=True, exist_ok=True)
        for name in os.listdir(commits):  # temp files of a killed writer (of commit markers)
            if paths.is_tmp(name):
                (commits / name).unlink(missing_ok=True)
        # markers after a gap (segments written before the commit log): a group commit's links
        # that a machine crash kept while losing an earlier one; readers stop at the gap
        seqnos = self.list_markers(segment)
        stale = [n for k, n in enumerate(seqnos) if n != k]
        for n in stale:
            paths.commit_marker(self.root, segment, n).unlink(missing_ok=True)
        log = paths.commit_log(self.root, segment)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                dirs.add(commits)  # the log may be new: its name becomes durable with the first record
            elif size > log_end:  # a record cut short or not backed by its data (a crash): cut it off
                os.ftruncate(fd, log_end)
                if self.durable:  # before any new record lands where the old bytes were
                    os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        if self.durable:
            self._logs[segment] = fd
        else:
            os.close(fd)
        if stale and self.durable:
            fsync_path(commits)

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

    def read_log(self, segment: str, offset: int, size: int = -1) -> bytes:
        try:
            with open(paths.commit_log(self.root, segment), "rb") as f:
                f.seek(offset)
                return f.read(size)
        except FileNotFoundError:
            return b""

    def append_log(self, segment: str, offset: int, record: bytes) -> Callable[[], None]:
        # the record is appended after the chunk data it commits was written, so a reader on
        # this machine never sees it before the data; the returned round makes the chunks, new
        # directories, metadata and the record durable together. A crash during that round may
        # keep the record and lose data: the record's data crc tells (``reader``).
        files, dirs = self._unsynced.pop(segment, ({}, set()))
        opened = self._open.get(segment, {})
        if not self.durable:  # nothing to sync: close instead (on NFS, close flushes the data)
            for path in files:
                _close(opened, path)
        fd = self._logs.get(segment)
        own = fd is None
        targets: list[int | str] = []
        try:
            if own:
                fd = os.open(paths.commit_log(self.root, segment), os.O_WRONLY)
            if os.fstat(fd).st_size != offset:
                raise FileExistsError(f"commit log of segment {segment} in {self.root} is not {offset} bytes long")
            if self.durable:
                # the round syncs duplicates of the descriptors: the next batch's writes may
                # close (evict) the originals meanwhile, and a closed number could be reused
                targets.append(os.dup(fd))
                targets += [os.dup(opened[p]) if p in opened else p for p in files]
            try:
                _pwrite_all(fd, record, offset, paths.commit_log(self.root, segment))
            except BaseException:
                os.ftruncate(fd, offset)  # a record that failed half-way is not left for the next one
                raise
        except BaseException:
            _close_all(targets)
            if self.durable:  # still to be synced, with the next record
                later = self._unsynced.setdefault(segment, ({}, set()))
                later[0].update(files)
                later[1].update(dirs)
            raise
        finally:
            if own and fd is not None:
                os.close(fd)
        if not self.durable:
            return _no_flush

        def flush_round() -> None:
            try:
                sync_together(targets, sorted(dirs))
            except OSError as err:  # a descriptor's sync names no file: the segment's filesystem it is
                raise named(err, paths.commit_log(self.root, segment))
            finally:
                _close_all(targets)

        return flush_round

    def sync_metadata(self, segment: str, key: str) -> None:
        if self.durable:
            path = paths.segment_data_dir(self.root, segment) / key
            sync_together([], [path, path.parent])  # Zarr replaced it by a rename

    def write_chunks(self, segment: str, pieces: list[Piece], buf: memoryview) -> None:
        base = self._data_dir(segment)
        files, dirs = self._unsynced.setdefault(segment, ({}, set()))
        opened = self._open.setdefault(segment, {})
        for key, chunk_bytes, offset, nbytes, at in pieces:
            path = os.path.join(base, key)
            fd = opened.get(path)
            if fd is None:
                try:
                    fd = os.open(path, os.O_WRONLY)
                except FileNotFoundError:
                    parent = Path(path).parent
                    dirs.update(_make_dirs(parent, Path(base)))
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
                    dirs.add(parent)
                if os.fstat(fd).st_size != chunk_bytes:  # new, or cut short by a killed writer
                    try:
                        os.ftruncate(fd, chunk_bytes)
                    except OSError as err:  # past a file-size limit: named like a failed write
                        os.close(fd)
                        raise named(err, path)
                opened[path] = fd
                while len(opened) > _MAX_OPEN:  # the oldest; if unsynced, it is synced by path
                    _close(opened, next(iter(opened)))
            _pwrite_all(fd, buf[at:at + nbytes], offset, path)
            files[path] = None

    def read_metadata(self, segment: str, key: str) -> bytes | None:
        try:
            with open(os.path.join(self._data_dir(segment), key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def release_segment(self, segment: str) -> None:
        for fd in self._open.pop(segment, {}).values():
            os.close(fd)
        fd = self._logs.pop(segment, None)
        if fd is not None:
            os.close(fd)

    def delete_segment(self, segment: str) -> None:
        """Renamed out of the listing first (one atomic step: no reader ever lists half a
        segment), then removed; a removal cut short leaves a hidden directory, not a segment."""
        self.release_segment(segment)
        self._unsynced.pop(segment, None)
        self._data_dirs.pop(segment, None)
        gone = paths.segments_root(self.root) / f".{segment}.{os.getpid()}.deleted.tmp"
        try:
            os.rename(paths.segment_dir(self.root, segment), gone)
        except FileNotFoundError:
            return
        shutil.rmtree(gone, ignore_errors=True)

    def read_chunks(self, segment: str, pieces: list[Piece], buf: memoryview) -> None:
        base = self._data_dir(segment)
        fds: dict[str, int] = {}
        try:
            for key, chunk_bytes, offset, nbytes, at in pieces:
                if key not in fds:
                    try:
                        fds[key] = os.open(os.path.join(base, key), os.O_RDONLY)
                    except FileNotFoundError:  # a writer makes each chunk file before a record names it
                        raise OSError(f"{os.path.join(base, key)} is missing under committed entries: the "
                                      "segment is damaged") from None
                fd = fds[key]
                got = os.preadv(fd, [buf[at:at + nbytes]], offset)
                if got != nbytes:
                    raise OSError(f"{os.path.join(base, key)} holds {offset + got} bytes, fewer than the "
                                  f"{offset + nbytes} its committed entries need (chunk size {chunk_bytes}): "
                                  "the segment is damaged")
        finally:
            for fd in fds.values():
                os.close(fd)

    def metadata_changed(self, segment: str, key: str) -> None:
        path = paths.segment_data_dir(self.root, segment) / key
        files, dirs = self._unsynced.setdefault(segment, ({}, set()))
        files.setdefault(str(path), None)
        dirs.add(path.parent)  # Zarr replaces the file by a rename


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int, path: str | os.PathLike) -> None:
    """Write all of ``data`` at ``offset`` of ``fd``. ``os.pwrite`` names no file in its error: it
    is raised naming ``path``, so a store on a filesystem of its own that fills is named, not the run's."""
    done = 0
    try:
        while done < len(data):
            done += os.pwrite(fd, data[done:], offset + done)
    except OSError as err:
        raise named(err, path)


def _no_flush() -> None:
    """The flush round of a store that is not durable."""


def _close_all(targets: list) -> None:
    for t in targets:
        if isinstance(t, int):
            os.close(t)


#: chunk files a backend keeps open for writing per segment (older ones are closed, and synced by path).
_MAX_OPEN = 64


def _close(opened: dict[str, int], path: str) -> None:
    fd = opened.pop(path, None)
    if fd is not None:
        os.close(fd)


def _make_dirs(d: Path, base: Path) -> list[Path]:
    """Create ``d`` and its missing parents up to ``base``; the directories whose entries
    changed (to fsync before a commit marker names their files)."""
    if d.exists():
        return []
    changed = _make_dirs(d.parent, base) if d.parent != base else []
    d.mkdir(exist_ok=True)
    return changed + [d.parent]


def open_backend(url: str, mode: str, durable: bool) -> StoreBackend:
    """The backend a store URL names: ``memory://<name>``, ``file:///abs/path`` or a directory
    path. ``mode="a"`` creates a memory store that does not exist and checks that a directory
    is writable and the user's alone (``UnsafeDir``: another user could change it); ``mode="r"``
    refuses a memory store that does not exist."""
    if url.startswith("memory://"):
        return open_memory_backend(url[len("memory://"):], mode)
    if "://" in url and not url.startswith("file://"):
        scheme = url.split("://", 1)[0]
        raise ValueError(
            f"unknown trajectory store scheme {scheme!r} in {url!r}: known are a plain directory "
            "path, 'file://', 'memory://'"
        )
    root = (file_url_path(url) if url.startswith("file://") else Path(url)).absolute()
    if mode == "a":
        check_store_dir(root)  # nothing made in a place another user could change
        check_writable_dir(root)
        check_store_dir(root)  # and what is there now is ours alone: the run trains from it
    return DirBackend(root, durable)
