"""Runtime room: one ``astraflow run`` per run directory.

A run holds an exclusive ``flock`` on ``control/run.lock`` from before it starts any process
until it exits. The kernel drops the lock when the holding process ends, however it ends, so a
crashed run never leaves a stale lock and running again on the directory (a resume) just works.
The file also says who holds it (pid, host, start time), for the message a second run gets.
The descriptor is not inheritable (PEP 446): the processes a run starts do not keep it alive.
On NFS, Linux maps ``flock`` to the server's byte-range locks, so runs on two hosts see each other.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shlex
import socket
import time
from pathlib import Path

from storage.ownership import make_owner_only
from storage.paths import RunPaths

log = logging.getLogger("astraflow.runtime")


class RunDirError(ValueError):
    """The run directory cannot be used: it cannot be created, or a live run holds it."""


class RunDirLock:
    """The exclusive lock of one run directory: ``with RunDirLock(run_dir): ...`` or
    ``acquire()`` / ``release()``. ``acquire`` raises ``RunDirError`` naming the run that holds
    the directory (or why it cannot be created) and the fix; ``UnsafeRunDir`` when the directory
    is not owner-only (`storage.ownership`), before anything is written in it."""

    def __init__(self, run_dir: str | Path):
        self.paths = RunPaths(run_dir)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "RunDirLock":
        if self._fd is not None:
            return self
        root, lock = self.paths.root, self.paths.run_lock
        try:
            make_owner_only(root)  # UnsafeRunDir (a ValueError) when other users can change it
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as err:
            where = f" ({err.filename})" if err.filename else ""
            raise RunDirError(f"run directory {root} cannot be created or written: {err.strerror or err}{where}; "
                              "pass a --run-dir in a place you can write to") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirError(
                f"run directory {root} is in use by a running `astraflow run` ({_describe(holder)}): pass "
                f"another --run-dir, or stop that run first ({_how_to_stop(root, holder)}) and run again on "
                "this directory to resume it") from None
        except OSError as err:  # a filesystem without locks: run unguarded rather than not at all
            log.warning("cannot lock %s (%s); nothing stops a second run on this directory", lock, err)
            os.close(fd)
            return self
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                "slurm_job": head_slurm_job()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Give the directory up (closing the descriptor drops the lock; the file stays)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # no holder to name any more
        finally:
            os.close(fd)

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def holder_of(run_dir: str | Path) -> dict:
    """What the run holding ``run_dir``'s lock wrote (pid, host, start); {} when none holds it (the
    file is emptied when a run lets go) or the file cannot be read. Takes no lock."""
    try:
        fd = os.open(RunPaths(run_dir).run_lock, os.O_RDONLY)
    except OSError:
        return {}
    try:
        return _read_holder(fd)
    finally:
        os.close(fd)


def _read_holder(fd: int) -> dict:
    """What the holder wrote (empty while it is still writing it)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def head_slurm_job() -> str | None:
    """The id of the Slurm job this process runs in (the head job's, for `astraflow run`), or
    None outside Slurm: recorded so that a user on another host (a login node, where `astraflow
    stop` cannot signal the process) is told which job to ``scancel``, and sees it in the status."""
    return os.environ.get("SLURM_JOB_ID") or None


def _how_to_stop(root: Path, holder: dict) -> str:
    """The commands that stop the run holding ``root``: ``astraflow stop`` (on the holder's host),
    and ``scancel`` of its head job where it runs in one; a run outside Slurm has no job to cancel."""
    stop = f"Ctrl-C, or `astraflow stop {shlex.quote(str(root))}`"
    job = holder.get("slurm_job")
    return f"{stop} on its host, or `scancel {job}`, its Slurm job" if job else stop


def _describe(holder: dict) -> str:
    if not holder:
        return "pid and host not recorded yet"
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    job = f" in Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{job}, started {when}"
