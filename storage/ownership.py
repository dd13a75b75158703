"""Directories a run acts on belong to the user who runs it.

On shared nodes other users are not trusted, and a run directory holds what the run acts on
(its config, the desired partitions the orchestrator reads, weight checkpoints). So a run
creates its directory owner-only (``make_owner_only``) and writes under ``owner_only()``'s
umask (files 0600, directories 0700), and every command that acts on a run directory first
refuses one that another user could change (``check_owner_only``): owned by someone else, or
writable by group or others, for the directory itself and its top-level subdirectories; a
symlink of another user on the way to it; or a directory above it in which another user could
rename entries (and so swap the run directory for one of theirs): one owned by someone other
than the user or root, or one writable by group or others without the sticky bit (``/tmp``
has it). An external trajectory store is held to the same rule (``check_store_dir``), and so
is the working directory before it goes on the import path (``add_user_dir``).
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from storage.paths import RunPaths

#: umask of every process that writes a run directory: no permission for group and others
OWNER_ONLY_UMASK = 0o077
#: the directory ``astraflow`` runs in, for the processes it starts to append to their import
#: path (``add_user_dir``); not ``PYTHONPATH``, whose entries come before the installed packages
USER_DIR_ENV = "ASTRAFLOW_USER_DIR"
#: the fix when another user can rename entries in a directory above
_ELSEWHERE = ("use a place where no other user can rename what is in any directory above it, such as your home "
              "or a scratch directory of your own")


class UnsafeDir(ValueError):
    """A directory the run would act on can be changed by other users; the message names the
    path and the fix."""


class UnsafeRunDir(UnsafeDir):
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
            paths.trainer_state, paths.security, paths.plots, paths.tensorboard]


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _walk(path: str | Path) -> tuple[list[tuple[str, os.stat_result]], bool]:
    """Every entry the kernel passes through to reach ``path``, in order, with its ``lstat``:
    each directory and each symlink (then what its target passes through); and whether
    ``path`` exists, its own entry (after its symlinks) being the last one then."""
    path = os.fspath(path)
    todo = [c for c in (path if os.path.isabs(path) else os.path.join(os.getcwd(), path)).split(os.sep) if c][::-1]
    cur, seen, links = os.sep, [(os.sep, os.lstat(os.sep))], 0
    while todo:
        name = todo.pop()
        if name == ".":
            continue
        if name == "..":  # ``cur`` has no symlinks left: its parent is the one the kernel takes
            if len(seen) > 1 and seen[-1][0] == cur:
                seen.pop()  # left behind: not a directory above ``path``
            cur = os.path.dirname(cur)
            continue
        nxt = os.path.join(cur, name)
        try:
            st = os.lstat(nxt)
        except OSError:  # missing (made later) or not searchable (using it fails anyway)
            return seen, False
        seen.append((nxt, st))
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > 40:  # the kernel's ELOOP
                return seen, False
            target = os.readlink(nxt)
            cur = os.sep if os.path.isabs(target) else cur
            todo.extend([c for c in target.split(os.sep) if c][::-1])
        elif todo and not stat.S_ISDIR(st.st_mode):
            return seen, False
        else:
            cur = nxt
    return seen, True


def _trusted(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def _others_write(st: os.stat_result) -> bool:
    """Whether users other than the owner may write the entry: others may, or its group may
    and the group is not the user's own private group (named as the user, their primary group,
    no other members: the group of every file under a umask of 002 on many distributions)."""
    return bool(st.st_mode & stat.S_IWOTH or st.st_mode & stat.S_IWGRP and not _private_group(st.st_gid))


def _private_group(gid: int) -> bool:
    try:
        import grp
        import pwd

        me, group = pwd.getpwuid(os.geteuid()), grp.getgrgid(gid)
    except (ImportError, KeyError):
        return False
    return gid == me.pw_gid and group.gr_name == me.pw_name and set(group.gr_mem) <= {me.pw_name}


#: what ``_problem`` finds: what is wrong, and the fix (None: the caller's "of your own"; one
#: that ends in " or": the caller's alternative follows)
Problem = tuple[str, str | None]


def _problem(path: str | Path) -> Problem | None:
    """What is wrong with the directory ``path``, or None when it is fine: it is not a directory
    of this user that only this user can write (if it exists), or another user could swap it for
    one of theirs without touching it: a symlink of theirs on the way, or a directory above it
    they can rename entries in."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        st = None
    except OSError as err:  # a directory on the way that this user may not search
        return f"cannot be checked ({err.strerror or err})", "make the directories above it searchable or"
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            return "is not a directory", "move it away or"
        if st.st_uid != os.geteuid():
            return f"is owned by {_owner(st.st_uid)}, not by you ({_owner(os.geteuid())})", None
        if _others_write(st):
            return (f"is writable by group/others (mode {stat.S_IMODE(st.st_mode):04o})",
                    f"run 'chmod go-w {path}' or")
    return swap_problem(path)


def swap_problem(path: str | Path) -> Problem | None:
    """``_problem``'s half that does not look at ``path`` itself: whether another user could swap
    it for one of theirs (a symlink of theirs on the way, a directory above it they can rename
    entries in), for directories checked otherwise (the sandbox's scratch root, a Dask worker's
    temporary directory, which may be root's such as ``/tmp``). None: no one can."""
    seen, exists = _walk(path)
    for entry, est in seen:
        # a symlink cannot be changed, only replaced by who may write its directory (checked
        # below) or, in a sticky one, by its owner
        if stat.S_ISLNK(est.st_mode) and not _trusted(est.st_uid) and _sticky_open(os.path.dirname(entry)):
            where = "is" if entry == os.path.abspath(path) else f"goes through {entry}, which is"
            return (f"{where} a symlink owned by {_owner(est.st_uid)}",
                    "remove it, or use a path of your own (the real one, if you trust where it points)")
    for entry, est in seen[:-1] if exists else seen:
        if not stat.S_ISDIR(est.st_mode):
            continue
        if not _trusted(est.st_uid):
            return (f"is inside {entry}, owned by {_owner(est.st_uid)}, who can rename or replace what is in it",
                    _ELSEWHERE)
        if _others_write(est) and not est.st_mode & stat.S_ISVTX:
            return (f"is inside {entry}, which group/others can write without the sticky bit (mode "
                    f"{stat.S_IMODE(est.st_mode):04o}), so they can rename or replace what is in it",
                    f"run 'chmod go-w {entry}' or" if est.st_uid == os.geteuid() else
                    f"ask its owner to set the sticky bit ('chmod +t {entry}', as on /tmp) or {_ELSEWHERE}; a "
                    "directory of your own inside it does not help")
    return None


def _sticky_open(directory: str) -> bool:
    """Whether ``directory`` is writable by others with the sticky bit (where each may remove
    their own entries), or cannot be looked at."""
    try:
        st = os.lstat(directory)
    except OSError:
        return True
    return _others_write(st) and bool(st.st_mode & stat.S_ISVTX)


def _check(path: Path, what: str, other: str, own: str, error: type[UnsafeDir] = UnsafeDir) -> None:
    """``error`` when another user could change the directory ``path`` (``_problem``); the
    message names it as ``what``, says what is wrong and the fix: ``own`` ("choose a run
    directory of your own") or ``other`` ("choose another run directory") where it applies."""
    found = _problem(path)
    if found:
        problem, fix = found
        fix = own if fix is None else f"{fix} {other}" if fix.endswith(" or") else fix
        raise error(f"{what} {path} {problem}: {fix}")


def check_owner_only(root: str | Path) -> None:
    """``UnsafeRunDir`` when the run directory ``root`` or one of its existing top-level
    subdirectories is not a directory owned by this user that only this user can write, or
    when another user could swap one for theirs (a symlink of theirs, a directory above it they
    can rename entries in). A ``root`` that does not exist yet passes if the directories above
    it are safe (it is created owner-only)."""
    paths = RunPaths(root)
    for path in [paths.root, *_subdirs(paths)]:
        what = "run directory" if path == paths.root else f"run directory {paths.root}: subdirectory"
        _check(path, what, "choose another run directory", "choose a run directory of your own", UnsafeRunDir)


def make_owner_only(root: str | Path) -> Path:
    """Create the run directory ``root`` with mode 0700 (missing parents as the umask says, but
    never writable by group or others: they would be unsafe above it), or check the existing
    one; ``UnsafeRunDir`` when others can change it. Checked before creating (nothing is made in
    another user's place) and after, so a directory another user made first under the same name
    is refused, not used."""
    root = RunPaths(root).root
    check_owner_only(root)
    make_parents(root)
    try:
        root.mkdir(mode=0o700)
    except FileExistsError:
        pass
    else:
        os.chmod(root, 0o700)  # exactly owner-only, whatever the umask
    check_owner_only(root)
    return root


def make_parents(path: str | Path) -> None:
    """Create the missing directories above ``path``, never writable by group or others
    (whatever the umask), as directories above a run's must not be."""
    for parent in reversed(Path(path).absolute().parents):
        if not parent.exists():
            parent.mkdir(mode=0o755, exist_ok=True)


def check_store_dir(root: str | Path) -> None:
    """``UnsafeDir`` when the trajectory store directory ``root`` (or its ``segments/``) is not
    this user's and only this user's, as a run directory must be: the run trains from what is
    in it. A ``root`` that does not exist yet passes if the directories above it are safe."""
    fixes = ("point storage.trajectories at another directory", "point storage.trajectories at a directory of your own")
    _check(Path(root), "trajectory store", *fixes)
    _check(Path(root) / "segments", f"trajectory store {root}: subdirectory", *fixes)


# -- the working directory on the import path -------------------------------------------------

def user_dir_problem(path: str | Path) -> str | None:
    """Why the directory ``path`` may not go on the import path (None: it may), by the rule of
    a run directory: a module there runs as this user."""
    found = _problem(path)
    return None if found is None else f"the working directory {path} {found[0]}"


_added: dict[str, str | None] = {}


def add_user_dir(path: str | Path | None = None) -> str | None:
    """Append the directory ``path`` (default: ``$ASTRAFLOW_USER_DIR``, set by ``astraflow`` for
    the processes it starts; unset: nothing to do) to the end of ``sys.path``, after the
    installed packages, so that a config's ``module:name`` imports from it and nothing there
    shadows an installed module; only if no other user can change it. Returns why it was not
    added (None: it was, or there is none). Cheap to call again."""
    path = os.environ.get(USER_DIR_ENV) if path is None else os.fspath(path)
    if not path:
        return None
    if path not in _added:
        _added[path] = user_dir_problem(path)
    if _added[path] is None and path not in sys.path:
        sys.path.append(path)
    return _added[path]


def user_dir_fix() -> str:
    """The fix for a config's module that does not import, for its error message; when the
    working directory was kept off the import path, it and why."""
    why = add_user_dir()
    if why is None:
        return "run from the directory that holds it, or install its package"
    return (f"{why}, so it is not on the import path (a module there would run as you): run from a directory "
            "only you can change, or install the module's package (pip install -e)")


def unbuildable(out: Path) -> str | None:
    """Why directory ``out`` (missing) cannot be created, or None: its nearest existing ancestor
    is a file, or no directory can be made in it (tried, and removed again: permissions, a
    read-only or special filesystem such as /proc). Nothing is left behind either way."""
    ancestor = Path(os.path.abspath(out)).parent
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is a file, not a directory"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".astraflow-probe-", dir=ancestor))
    except OSError as err:
        return f"no directory can be created in {ancestor} ({err.strerror or err})"
    return None
