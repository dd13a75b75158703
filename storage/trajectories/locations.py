"""Trajectory store, locations room: where a store URL points, apart from the bytes kept there.

Why it exists: a store URL is judged in several places that need no backend: the config
refuses one no run can use from its text alone (``store_url_problem``), ``astraflow check`` and
``run`` refuse a directory that is not the user's alone or cannot be created (``check_store_url``),
the CLI finds the run a store belongs to (``owning_run``), and ``backends.open_backend`` turns a
``file://`` URL into its directory and checks that directory before writing into it.
"""

from __future__ import annotations

import os
from pathlib import Path

from storage import paths
from storage.ownership import check_store_dir, make_parents, unbuildable


#: the forms of store URL a run takes, as errors name them
STORE_FORMS = "a directory path or a file:///abs/path URL"


def store_url_problem(url: str) -> str | None:
    """Why no run can keep its trajectories at ``url`` (``storage.trajectories``), from the text
    alone: a scheme other than ``file://``, a ``file://`` URL naming another host or no absolute
    path. None: a directory on this machine (or ``memory://``, which the config refuses itself)."""
    if "://" in url and not url.startswith(("file://", "memory://")):
        return f"{url!r}: no store reads scheme {url.split('://', 1)[0]!r}; give {STORE_FORMS} (shared storage mounted)"
    try:
        path = file_url_path(url) if url.startswith("file://") else None
    except ValueError as err:  # another host (the message names file:///abs/path)
        return str(err)
    if path is not None and not path.is_absolute():
        return f"{url!r} names no absolute path: give {STORE_FORMS}, e.g. file:///scratch/trajectories"
    return None


def check_store_url(url: str) -> None:
    """Refuse a store URL before a run starts rather than when its data layer opens the store:
    ``ValueError`` for one no run can use (`store_url_problem`), ``UnsafeDir`` (a ``ValueError``)
    when its directory is not the user's alone, as a run directory must be (one that does not
    exist yet: when another user could change the directories above it), ``OSError`` when it
    does not exist and cannot be created (a probe made and removed in its nearest existing
    ancestor: a file in the way, a read-only or special file system such as /proc)."""
    if url.startswith("memory://"):
        return
    problem = store_url_problem(url)
    if problem:
        raise ValueError(problem)
    root = (file_url_path(url) if url.startswith("file://") else Path(url)).absolute()
    check_store_dir(root)
    if not os.path.lexists(root) and (why := unbuildable(root)):
        raise OSError(f"trajectory store directory {root} cannot be created: {why}; give {STORE_FORMS} that this "
                      "user can create")


def owning_run(url: str) -> Path | None:
    """The run directory whose own trajectory store (``<run>/trajectories``, a run's when its
    config names none) ``url`` is or lies in; None: no run's. Such a store belongs to that run:
    it deletes the segments it no longer needs when it keeps no trajectories, another run's
    among them."""
    if url.startswith("memory://") or store_url_problem(url):
        return None
    root = (file_url_path(url) if url.startswith("file://") else Path(url)).resolve()
    for place in (root, *root.parents):
        run = paths.RunPaths(place.parent)
        if place == run.trajectories and run.run_lock.is_file():  # every run takes it first
            return run.root
    return None


def file_url_path(url: str) -> Path:
    """The local path of a ``file://`` URL (percent-escapes decoded; host empty or ``localhost``)."""
    from urllib.parse import urlparse
    from urllib.request import url2pathname

    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"trajectory store URL {url!r} names host {parsed.netloc!r}: a file:// store is on this "
                         "machine's file system (file:///abs/path); shared storage is a mounted directory")
    return Path(url2pathname(parsed.path))


def check_writable_dir(root: Path) -> None:
    try:
        make_parents(root)
        root.mkdir(mode=0o755, exist_ok=True)  # as the umask says, but not writable by group/others
        probe = paths.tmp_sibling(root / "write-probe")
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(
            f"trajectory store directory {root} is not writable ({e.strerror or e}): point the store "
            "at a directory this process can create files in, or open it with mode='r' to only read"
        ) from e
