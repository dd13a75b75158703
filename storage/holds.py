"""Readers' hold files: how a weight-store reader keeps the version it reads from retention.

A hold is a small JSON file (the reader's pid, host and start time) under
``paths.readers_dir``. Retention skips a version with a live hold. A hold of a dead pid on this
host, or one older than the store's ``hold_timeout_s``, is stale: a killed reader never removes
its own, and another host's pid cannot be checked from here.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

from storage import paths
from storage.atomic import write_atomically
from storage.full_disk import is_full_disk, lack_of_room


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def take(root: Path, policy: str, version: int, host: str) -> Path:
    """Write this process's hold on ``version``; returns the file (unlink it to release)."""
    hold = paths.hold_file(root, policy, version, f"{os.getpid()}-{uuid.uuid4().hex[:12]}")
    try:
        hold.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(hold, json.dumps({"pid": os.getpid(), "host": host, "since": time.time()}).encode())
    except OSError as err:
        way = lack_of_room(err.errno) if is_full_disk(err) else "give this process write access to the store"
        raise OSError(err.errno, f"cannot write a reader's hold file in {hold.parent} ({err.strerror}): "
                                 "readers of a weight store write there to keep the version they read from "
                                 f"retention; {way}", str(hold)) from err
    return hold


def held(root: Path, policy: str, host: str, timeout_s: float) -> set[int]:
    """Versions of ``policy`` with a live hold; stale holds are removed on the way."""
    d = paths.readers_dir(root, policy)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return set()
    out = set()
    for n in names:
        m = paths.HOLD_FILE_RE.match(n)
        if not m:
            continue
        try:
            rec = json.loads((d / n).read_text())
        except FileNotFoundError:
            continue  # released while we listed
        except json.JSONDecodeError:
            out.add(int(m.group(1)))  # being written: count it
            continue
        if (rec.get("host") == host and not pid_alive(int(rec["pid"]))
                or time.time() - float(rec.get("since", 0.0)) > timeout_s):
            (d / n).unlink(missing_ok=True)
            continue
        out.add(int(m.group(1)))
    return out


def discard_all(root: Path, policy: str) -> int:
    """Remove every hold on ``policy``'s versions, however alive its owner looks; returns how
    many were removed."""
    d = paths.readers_dir(root, policy)
    holds = [d / n for n in (os.listdir(d) if d.is_dir() else []) if paths.HOLD_FILE_RE.match(n)]
    for h in holds:
        h.unlink(missing_ok=True)
    return len(holds)
