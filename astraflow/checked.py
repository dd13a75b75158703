"""Remembered passes of a costly check whose inputs are all known: a check that passed on
exactly these inputs (hashed together with the checking module's own source, so that a changed
check runs again) is not run again. The marks live under ``$XDG_CACHE_HOME/astraflow/checked``
(``~/.cache`` by default; ``$ASTRAFLOW_CACHE_DIR/checked`` where that is set), readable by the
user alone; a cache that cannot be read or written only means that the check runs."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from storage.ownership import make_parents


#: a directory for AstraFlow's cache that overrides the XDG one
CACHE_ENV = "ASTRAFLOW_CACHE_DIR"


def cache_dir() -> Path:
    """Where the marks are kept: ``$ASTRAFLOW_CACHE_DIR/checked`` where that is set."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]) / "checked"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "astraflow" / "checked"


def check_key(kind: str, inputs: Any, checker: str | Path) -> str:
    """The key of a check of ``kind`` on ``inputs`` (JSON-serialisable) by the module at
    ``checker`` (its source is part of the key)."""
    digest = hashlib.sha256()
    digest.update(kind.encode())
    digest.update(Path(checker).read_bytes())
    digest.update(json.dumps(inputs, sort_keys=True, default=str).encode())
    return f"{kind}-{digest.hexdigest()}"


def passed_before(key: str) -> bool:
    """Whether a check of this key passed before."""
    try:
        return (cache_dir() / key).is_file()
    except OSError:
        return False


def remember_pass(key: str) -> None:
    """Mark the check of this key as passed (nothing when the cache cannot be written)."""
    where = cache_dir()
    try:
        make_parents(where)  # a missing ~/.cache not writable by others, whatever the umask
        where.mkdir(mode=0o700, exist_ok=True)
        (where / key).touch()
    except OSError:
        pass
