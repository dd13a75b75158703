"""Writes refused for want of room: a full filesystem (ENOSPC), an exceeded quota (EDQUOT) or a
file-size limit (EFBIG: ``ulimit -f``, or the largest file a filesystem takes).

Such an error often arrives wrapped: torch's zip writer raises a ``RuntimeError`` of its own
with the ``OSError`` as its context, and DCP's ``CheckpointException`` carries each rank's
error. A quota does not show in ``df`` (Lustre, GPFS, NFS), so the errno is looked for in the
chain rather than guessed from the free space.
"""

from __future__ import annotations

import errno
import os

#: the errnos of a write refused for want of room
FULL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def is_full_disk(err: BaseException) -> bool:
    """Whether ``err`` itself is a write refused for want of room (see `FULL_DISK_ERRNOS`)."""
    return isinstance(err, OSError) and err.errno in FULL_DISK_ERRNOS


def full_disk_in(err: BaseException) -> OSError | None:
    """The ``OSError`` of a full filesystem, quota or file-size limit anywhere in ``err``'s chain
    (its causes, contexts, and the per-rank failures of a torch ``CheckpointException``), or None."""
    seen: set[int] = set()
    todo: list[BaseException] = [err]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if is_full_disk(e):
            return e  # type: ignore[return-value]
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        failures = getattr(e, "failures", None)  # rank -> (exception, its stack summary)
        for failure in failures.values() if isinstance(failures, dict) else ():
            first = failure[0] if isinstance(failure, tuple) and failure else failure
            if isinstance(first, BaseException):
                todo.append(first)
    return None


def lack_of_room(code: int | None) -> str:
    """What refused a write for want of room, and what to do, in a few words."""
    if code == errno.EDQUOT:
        return "the disk quota is exceeded: free space within it (`quota -s`, `lfs quota`) or have it raised"
    if code == errno.EFBIG:
        return "a file outgrew the file-size limit (`ulimit -f`): raise it"
    return "the disk is full: free space there"


def named(err: OSError, path: str | os.PathLike) -> OSError:
    """``err``, naming ``path`` when it names no file (``os.pwrite``, a file object's ``write``
    and ``os.fsync`` name none): a full disk's message then names the filesystem that filled.
    The errno is kept; a new error has ``err`` as its cause."""
    if err.filename is not None or err.errno is None:
        return err
    out = OSError(err.errno, err.strerror or os.strerror(err.errno), os.fspath(path))
    out.__cause__ = err
    return out
