"""The one way to write a file of the run directory atomically.

Write a temp sibling, fsync it, rename (or hard-link, for create-only files) it over the final
name, then fsync the directory: a reader sees the old file or the new one, never part of one,
and after the call returns the file survives a crash of the machine. Writers of the run
directory's files go through ``write_atomically`` / ``write_json`` / ``create_atomically`` (or
``create_in_order``: several files of one directory, committed together); readers of a JSON
file that a person may have edited or damaged use ``read_json_object``. Whole directories (a
weight version, a delta, an export) are committed by their own rename and marker instead, and
the run's secret files are created exclusively with their mode (``runtime.security``).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

from storage.full_disk import named
from storage.paths import tmp_sibling


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by path; its error names ``path`` (a network filesystem may
    report a full disk only here)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        raise named(err, path)
    finally:
        os.close(fd)


def _fdatasync(file: Path | str | int) -> None:
    if isinstance(file, int):  # an open file descriptor
        os.fdatasync(file)
        return
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


_SYNC_POOL: tuple[int, ThreadPoolExecutor] | None = None


def sync_together(data_files: Iterable[Path | str | int] = (), full: Iterable[Path] = ()) -> None:
    """fdatasync ``data_files`` (paths or open descriptors) and fsync ``full`` (files or
    directories) concurrently: the calls release the GIL, so the disk flushes them in one round
    instead of one after another."""
    global _SYNC_POOL
    jobs = [(_fdatasync, p) for p in data_files] + [(fsync_path, p) for p in full]
    if len(jobs) <= 1:
        for fn, p in jobs:
            fn(p)
        return
    if _SYNC_POOL is None or _SYNC_POOL[0] != os.getpid():  # a forked child inherits no threads
        _SYNC_POOL = (os.getpid(), ThreadPoolExecutor(max_workers=8, thread_name_prefix="fsync"))
    for f in [_SYNC_POOL[1].submit(fn, p) for fn, p in jobs]:
        f.result()


def _write_tmp(final: Path, data: bytes, durable: bool) -> Path:
    """``data`` in a temp sibling of ``final``; a failed write names ``final`` (a file object's
    write names no file, and a full disk's message must name the filesystem that filled)."""
    tmp = tmp_sibling(final)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise named(err, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_atomically(final: Path, data: bytes | str, durable: bool = True) -> None:
    """Replace ``final`` with ``data`` (temp, fsync, rename, fsync the directory).
    ``durable=False`` skips both fsyncs (still atomic for readers; for files that are rewritten
    every few seconds and cost nothing to lose, such as a status snapshot)."""
    final = Path(final)
    tmp = _write_tmp(final, data.encode() if isinstance(data, str) else data, durable)
    try:
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        fsync_path(final.parent)


def create_atomically(final: Path, data: bytes | str, durable: bool = True) -> None:
    """Create ``final`` with ``data`` only if it does not exist (``FileExistsError`` otherwise):
    temp, fsync, hard link, fsync the directory. Readers see the whole file or nothing."""
    create_in_order([(final, data)], durable=durable)


def create_in_order(files: list[tuple[Path, bytes | str]], durable: bool = True, *,
                    along_data: Iterable[Path | str | int] = (), along: Iterable[Path] = ()) -> None:
    """``create_atomically`` for several files of one directory, created in the given order
    (a reader that sees one sees those before it) and made durable together: their temp files,
    ``along_data`` (fdatasynced) and ``along`` (fsynced, directories too; what the files
    commit) in one concurrent flush before the first link, the directory once after the last.
    ``FileExistsError`` at the first that exists; those before it stay created."""
    finals = [Path(f) for f, _ in files]
    assert len({f.parent for f in finals}) <= 1, "create_in_order creates files of one directory"
    tmps: list[Path] = []
    try:
        for final, (_, data) in zip(finals, files):
            tmps.append(_write_tmp(final, data.encode() if isinstance(data, str) else data, durable=False))
        if durable:
            sync_together(along_data, [*tmps, *along])
        for tmp, final in zip(tmps, finals):
            os.link(tmp, final)
    finally:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)
    if durable and finals:
        fsync_path(finals[0].parent)


def write_json(final: Path, data: Any, durable: bool = True, **dumps: Any) -> None:
    """``write_atomically`` of ``json.dumps(data, **dumps)`` (``default=str`` unless given)."""
    dumps.setdefault("default", str)
    write_atomically(final, json.dumps(data, **dumps), durable=durable)


class UnreadableFile(ValueError):
    """A file of the run directory exists but is not what its writer writes (not UTF-8, not
    JSON, not a JSON object, or unreadable); the message names the file and what is wrong."""


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; `UnreadableFile` when it is anything else."""
    try:
        data = json.loads(Path(path).read_bytes().decode("utf-8"))
    except (OSError, ValueError) as err:  # ValueError: not UTF-8 or not JSON
        raise UnreadableFile(f"{path} cannot be read as JSON ({type(err).__name__}: {err})") from None
    if not isinstance(data, dict):
        raise UnreadableFile(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data
