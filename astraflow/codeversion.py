"""Which code a process runs, so that a run's workers can be checked against its orchestrator.

A worker imports AstraFlow when it starts. One that starts after the installed code changed (a
replaced node, one the autoscaler adds, a restarted trainer) or whose Slurm job runs another
environment would run other code beside the run's, which fails in ways that name nothing
useful (a pickled class with other fields, a weight format read another way). The fingerprint
is the Python and torch versions and a hash of every source file of AstraFlow's packages; the
orchestrator compares each worker's with its own before it places an actor there.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import platform
from pathlib import Path
from typing import Any

#: the packages whose source a fingerprint covers
PACKAGES = ("astraflow", "storage", "schedulers")
#: the installed distributions whose versions it records
DISTRIBUTIONS = ("torch", "dask", "distributed", "zarr")
#: changed files a difference names (the rest are counted)
NAMED_FILES = 3


@functools.cache
def code_fingerprint() -> dict[str, Any]:
    """This process's fingerprint (computed once: a worker's is taken soon after it started)."""
    files: dict[str, str] = {}
    for package in PACKAGES:
        root = Path(importlib.import_module(package).__file__).parent
        for path in sorted(root.rglob("*.py")):
            files[f"{package}/{path.relative_to(root).as_posix()}"] = hashlib.sha1(path.read_bytes()).hexdigest()[:16]
    versions = {}
    for dist in DISTRIBUTIONS:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {"python": platform.python_version(), "versions": versions, "files": files}


def differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """What differs between two fingerprints, one phrase each (empty: the same code)."""
    out = []
    if _minor(mine.get("python")) != _minor(theirs.get("python")):  # a patch release runs the same code
        out.append(f"Python {theirs.get('python')} instead of {mine.get('python')}")
    for dist, v in (mine.get("versions") or {}).items():
        other = (theirs.get("versions") or {}).get(dist)
        if _public(other) != _public(v):  # a build label (torch's +cpu, +cu130) is the same release
            out.append(f"{dist} {other} instead of {v}")
    a, b = mine.get("files") or {}, theirs.get("files") or {}
    changed = sorted(f for f in a.keys() | b.keys() if a.get(f) != b.get(f))
    if changed:
        named = ", ".join(changed[:NAMED_FILES]) + (f" and {len(changed) - NAMED_FILES} more"
                                                    if len(changed) > NAMED_FILES else "")
        out.append(f"{len(changed)} source file(s) differ ({named})")
    return out


def _minor(version: Any) -> str | None:
    """``3.11`` of ``3.11.7``."""
    return ".".join(str(version).split(".")[:2]) if version else None


def _public(version: Any) -> str | None:
    """A version without its local build label: ``2.13.0`` of ``2.13.0+cpu``."""
    return str(version).split("+", 1)[0] if version else None
