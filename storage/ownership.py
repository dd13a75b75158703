"""A run directory belongs to the user who runs it.

On shared nodes other users are not trusted, and a run directory holds what the run acts on
(its config, the desired partitions the orchestrator reads, weight checkpoints). So a run
creates its directory owner-only (``make_owner_only``) and writes under ``owner_only()``'s
umask (files 0600, directories 0700), and every command that acts on a run directory first
refuses one that another user could change (``check_owner_only``): owned by someone else, or
writable by group or others, for the directory itself and its top-level subdirectories.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from storage.paths import RunPaths

#: umask of every process that writes a run directory: no permission for group and others
OWNER_ONLY_UMASK = 0o077


class UnsafeRunDir(ValueError):
    """The run directory (or one of its top-level subdirectories) can be changed by other
    users; the message names the path and the fix."""


@contextlib.contextmanager
def owner_only() -> Iterator[None]:
    """Create files and directories owner-only while the block runs (processes started inside
    inherit the umask); the previous umask is restored after it."""
    old = os.umask(OWNER_ONLY_UMASK)
    try:
        yield
    finally:
        os.umask(old)


def _subdirs(paths: RunPaths) -> list[Path]:
    """The top-level subdirectories a run writes (those that exist are checked)."""
    return [paths.control, paths.logs, paths.jobs, paths.trajectories, paths.weights,
            paths.root / "trainer_state", paths.root / "security", paths.plots, paths.tensorboard]


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _check_one(path: Path, root: Path) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    what = "run directory" if path == root else f"run directory {root}: subdirectory"
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeRunDir(f"{what} {path} is not a directory: move it away or choose another run directory")
    if st.st_uid != os.geteuid():
        raise UnsafeRunDir(f"{what} {path} is owned by {_owner(st.st_uid)}, not by you ({_owner(os.geteuid())}): "
                           "choose a run directory of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeRunDir(f"{what} {path} is writable by group/others (mode {stat.S_IMODE(st.st_mode):04o}): "
                           f"run 'chmod go-w {path}' or choose another run directory")


def check_owner_only(root: str | Path) -> None:
    """``UnsafeRunDir`` when the run directory ``root`` or one of its existing top-level
    subdirectories is not a directory owned by this user that only this user can write.
    A ``root`` that does not exist yet passes (it is created owner-only)."""
    paths = RunPaths(root)
    for path in [paths.root, *_subdirs(paths)]:
        _check_one(path, paths.root)


def make_owner_only(root: str | Path) -> Path:
    """Create the run directory ``root`` with mode 0700 (missing parents as the umask says), or
    check the existing one; ``UnsafeRunDir`` when others can change it. Checked after creating,
    so a directory another user made first under the same name is refused, not used."""
    root = RunPaths(root).root
    try:
        root.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    else:
        os.chmod(root, 0o700)  # exactly owner-only, whatever the umask
    check_owner_only(root)
    return root
