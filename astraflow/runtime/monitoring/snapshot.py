"""Monitoring room: the files that say how a run is doing, and the one rule for "running".

The orchestrator writes ``control/orchestrator.json`` (pid, host, dashboard) once,
``control/status.json`` every tick and ``summary.json`` when the run ends. Every reader (the
``astraflow status`` text, the status view of the page and of ``status --json``, the
partitions commands, the TensorBoard mirror) reads them through `read_snapshot`, so they agree
on whether the run is alive: the orchestrator's process exists (checked on its own host) and
its snapshot is younger than `STALE_AFTER_S`, and there is no summary yet. Nothing here needs a
connection to the cluster: a run directory on shared storage is enough.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage.atomic import UnreadableFile, read_json_object, write_json
from storage.paths import RunPaths

#: a status snapshot older than this means the orchestrator is not running any more.
STALE_AFTER_S = 30.0


class RunNotRunning(ValueError):
    """The run directory has no live orchestrator."""


# -- writing (the orchestrator) ------------------------------------------------------------------

def write_orchestrator_info(paths: RunPaths, dashboard: str | None, scheduler: str | None) -> None:
    """Who runs the orchestrator (pid, host, start time) and where its dashboard is."""
    write_json(paths.orchestrator_file,
               {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                "dashboard": dashboard, "scheduler": scheduler},
               indent=2)


def write_status(paths: RunPaths, status: dict[str, Any]) -> None:
    """Publish the status snapshot. Rewritten every tick, so not fsynced: a crash loses at
    most the last snapshot, which the next run overwrites anyway."""
    write_json(paths.status_file, status, durable=False, indent=2)


def write_summary(paths: RunPaths, summary: dict[str, Any]) -> None:
    """Publish the final state of the run (durably: it is the run's record)."""
    write_json(paths.summary, summary, indent=2)


def archive_summary(paths: RunPaths) -> None:
    """A run directory run again (resumed): keep the previous run's summary aside."""
    if paths.summary.exists():
        paths.summary.rename(paths.archived_summary(int(time.time())))


# -- reading (the CLI, the dashboard page) -------------------------------------------------------

#: what to do about each status file that cannot be read (`_read_json`)
_FIXES = {
    "status.json": "the run's orchestrator rewrites it every tick; if no run is running there, delete it",
    "orchestrator.json": "written when a run starts; if no run is running there, delete it",
    "summary.json": "the record of how the run ended; restore it from a copy, or move it aside to read the rest",
}


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, None when it does not exist; `UnreadableFile` (a
    ``ValueError``) naming the file and the fix when it is damaged."""
    if not path.exists():
        return None
    try:
        return read_json_object(path)
    except UnreadableFile as err:
        raise UnreadableFile(f"{err}: {_FIXES.get(path.name, 'restore or delete it')}") from None


def orchestrator_alive(info: dict[str, Any]) -> bool:
    """Whether the process named in ``orchestrator.json`` exists (True on another host: there
    only the snapshot's age can tell)."""
    if info.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Snapshot:
    """The status files of one run directory, read once."""

    paths: RunPaths
    status: dict[str, Any] | None
    """``control/status.json``; None before the orchestrator's first tick."""
    summary: dict[str, Any] | None
    """``summary.json``; None until the run ended."""
    info: dict[str, Any]
    """``control/orchestrator.json``; empty before the orchestrator started."""
    age_s: float | None
    """Seconds since the status snapshot was written; None without one (or without its time)."""

    @property
    def written_at(self) -> float | None:
        return self.status.get("written_at") if self.status is not None else None

    @property
    def finished(self) -> bool:
        return self.summary is not None

    @property
    def running(self) -> bool:
        return (bool(self.info) and orchestrator_alive(self.info) and self.age_s is not None
                and self.age_s < STALE_AFTER_S and self.summary is None)

    @property
    def stale(self) -> bool:
        """A snapshot exists and its writer stopped writing it."""
        return self.status is not None and (self.age_s is None or self.age_s > STALE_AFTER_S)


def read_snapshot(run_dir: Path | str, now: float | None = None) -> Snapshot:
    """The status files of the run in ``run_dir`` (any of them may be missing)."""
    paths = RunPaths(Path(run_dir))
    now = time.time() if now is None else now
    status = _read_json(paths.status_file)
    written = status.get("written_at") if status is not None else None
    return Snapshot(paths=paths, status=status, summary=_read_json(paths.summary),
                    info=_read_json(paths.orchestrator_file) or {},
                    age_s=(now - written) if written is not None else None)


def run_status(run_dir: Path, require_running: bool = True) -> dict[str, Any]:
    """The latest status snapshot of the run in ``run_dir``, with ``running`` and
    ``orchestrator`` (its ``orchestrator.json``) added. Raises `RunNotRunning` with what to do
    when there is no snapshot, or (``require_running``) when the run is not running."""
    paths = RunPaths(run_dir)
    if not paths.root.is_dir():
        raise RunNotRunning(f"{run_dir} is not a run directory: pass the --run-dir of `astraflow run`")
    if not paths.orchestrator_file.exists() or not paths.status_file.exists():
        if paths.summary.exists():
            raise RunNotRunning(f"the run in {run_dir} has finished; its final state is in {paths.summary}")
        raise RunNotRunning(f"no run has started in {run_dir} yet (no {paths.status_file.name})")
    snap = read_snapshot(run_dir)
    status = dict(snap.status or {})
    status["running"] = snap.running
    status["orchestrator"] = snap.info
    if require_running and not snap.running:
        hint = f"its final state is in {paths.summary}" if snap.finished else "it stopped without a summary"
        raise RunNotRunning(f"the run in {run_dir} is not running ({hint})")
    return status
