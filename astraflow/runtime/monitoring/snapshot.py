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
from storage.holds import pid_alive
from storage.paths import RunPaths

#: a status snapshot older than this means the orchestrator is not running any more.
STALE_AFTER_S = 30.0


class RunNotRunning(ValueError):
    """The run directory has no live orchestrator."""


# -- writing (the orchestrator) ------------------------------------------------------------------

def write_orchestrator_info(paths: RunPaths, dashboard: str | None, scheduler: str | None) -> None:
    """Who runs the orchestrator (pid, host, start time, the Slurm job it runs in) and where its
    dashboard is."""
    from astraflow.runtime.runlock import head_slurm_job

    write_json(paths.orchestrator_file,
               {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                "slurm_job": head_slurm_job(), "dashboard": dashboard, "scheduler": scheduler},
               indent=2)


def write_status(paths: RunPaths, status: dict[str, Any]) -> None:
    """Publish the status snapshot. Rewritten every tick, so not fsynced: a crash loses at
    most the last snapshot, which the next run overwrites anyway."""
    write_json(paths.status_file, status, durable=False, indent=2)


def write_summary(paths: RunPaths, summary: dict[str, Any]) -> None:
    """Publish the final state of the run (durably: it is the run's record)."""
    write_json(paths.summary, summary, indent=2)


def archive_summary(paths: RunPaths) -> None:
    """A run directory run again (resumed): keep the previous run's summary aside, under a
    name no other incarnation's summary has (two ended in the same second get ``-2``, ...)."""
    if not paths.summary.exists():
        return
    stamp, n = int(time.time()), 1
    while True:
        kept = paths.archived_summary(stamp) if n == 1 else paths.root / f"summary.{stamp}-{n}.json"
        try:
            os.link(paths.summary, kept)  # never replaces a kept summary, as a rename would
        except FileExistsError:
            n += 1
            continue
        except OSError:  # a filesystem without hard links
            if kept.exists():
                n += 1
                continue
            paths.summary.rename(kept)
            return
        paths.summary.unlink()
        return


# -- reading (the CLI, the dashboard page) -------------------------------------------------------

#: what to do about each status file that cannot be read (`_read_json`)
_FIXES = {
    "status.json": "the run's orchestrator rewrites it every tick; if no run is running there, delete it",
    "orchestrator.json": "written when a run starts; if no run is running there, delete it",
    "summary.json": "the record of how the run ended; restore it from a copy, or move it aside to read the rest",
}


@dataclass(frozen=True)
class _Obj:
    """A JSON object whose ``fields`` fit these specs (types, `_Obj` or `_Each`) where present;
    the ``required`` ones must be present. ``null``: null is allowed too."""

    fields: dict[str, Any]
    required: tuple[str, ...] = ()
    null: bool = False


@dataclass(frozen=True)
class _Each:
    """A JSON object (``of`` dict: one entry per partition, worker, ...) or list whose every
    value fits ``item``. ``null``: null is allowed too."""

    item: Any
    of: type = dict
    null: bool = False


_NUM = (int, float)
_NONE = type(None)

#: what the readers (the text status, the status view, the partitions commands) take from each
#: status file, and its type: a field of a wrong type, or a required one missing, makes the file
#: damaged (its writer always writes them so, and a reader would fail on them)
_INFO = _Obj({"pid": int, "host": str, "started": _NUM, "dashboard": (str, _NONE), "scheduler": (str, _NONE),
              "slurm_job": (str, _NONE)}, required=("pid", "host"))
_STATUS = _Obj({
    "written_at": (*_NUM, _NONE),
    "data_layer": _Obj({
        "elapsed_s": _NUM, "episodes_per_s": _NUM, "sequences_per_s": _NUM, "generated_tokens_per_s": _NUM,
        "buffers": dict, "ledger": _Obj({"states": dict}), "eval": _Each(_Obj({"eval_accuracy": _NUM}), list),
        "nodes": _Each(_Obj({"idle_fraction": _NUM, "generated_tokens_per_s": _NUM}))}),
    "trainers": _Each(_Obj({"version": int, "wait_fraction": _NUM, "last_metrics": _Obj({"reward_mean": _NUM})},
                           required=("version",))),
    "trainer_restarts": _Each(dict, null=True),
    "data_layer_restarts": _Obj({"restarts": _Each(dict, list)}, null=True),
    "partitions": _Each(_Obj({
        "scheduler": str, "role": str, "nodes": int, "slurm_partition": (str, _NONE), "state": str,
        "live": _NUM, "serving": _NUM, "completed": _NUM, "failures": _NUM, "jobs": dict,
        "episodes_per_s": _NUM, "tokens_per_s": _NUM, "refill_in_s": (*_NUM, _NONE),
        "staleness_mean": (*_NUM, _NONE), "versions": _Each(list),
        "autoscale": _Obj({"min_nodes": int, "max_nodes": int, "cooldown_s": _NUM},
                          required=("min_nodes", "max_nodes", "cooldown_s"), null=True)},
        required=("scheduler", "role", "nodes"))),
    "workers": _Each(_Obj({"job_id": str, "state": str, "phase": str}, required=("job_id", "state"))),
    "autoscale": _Obj({
        "config": _Obj({"low_wait": _NUM, "high_wait": _NUM, "window_s": _NUM,
                        "max_stale_fraction": (*_NUM, _NONE)}),
        "last": _Obj({"action": str, "reason": str}, required=("action", "reason"), null=True),
        "changes": _Each(_Obj({"t": _NUM, "reason": str}, required=("t", "reason")), list)}, null=True),
})
#: the JSON name of each Python type a status file holds
_JSON_TYPES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
               dict: "an object", _NONE: "null"}


def _kind(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _check(value: Any, spec: Any, where: str) -> None:
    """`UnreadableFile` saying what is wrong at ``where`` (a dotted path) unless ``value`` fits ``spec``."""
    if isinstance(spec, (_Obj, _Each)) and value is None and spec.null:
        return
    if isinstance(spec, _Each):
        if not isinstance(value, spec.of):
            raise UnreadableFile(f"{where} is {_kind(value)}, not {_JSON_TYPES[spec.of]}")
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            _check(item, spec.item, f"{where}[{key}]" if isinstance(value, list) else f"{where}.{key}")
    elif isinstance(spec, _Obj):
        if not isinstance(value, dict):
            raise UnreadableFile(f"{where} is {_kind(value)}, not an object")
        for name in spec.required:
            if name not in value:
                raise UnreadableFile(f"{where}.{name} is missing" if where else f"{name} is missing")
        for name, sub in spec.fields.items():
            if name in value:
                _check(value[name], sub, f"{where}.{name}" if where else name)
    else:
        types = spec if isinstance(spec, tuple) else (spec,)
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            wanted = dict.fromkeys("a number" if t in _NUM and float in types else _JSON_TYPES[t] for t in types)
            raise UnreadableFile(f"{where} is {_kind(value)}, not {' or '.join(wanted)}")


def _read_json(path: Path, spec: _Obj | None = None) -> dict[str, Any] | None:
    """The JSON object in ``path``, None when it does not exist; `UnreadableFile` (a
    ``ValueError``) naming the file and the fix when it is damaged (not a JSON object, or not
    fitting ``spec``)."""
    if not path.exists():
        return None
    try:
        data = read_json_object(path)
        if spec is not None:
            try:
                _check(data, spec, "")
            except UnreadableFile as err:
                raise UnreadableFile(f"{path} is damaged ({err})") from None
        return data
    except UnreadableFile as err:
        raise UnreadableFile(f"{err}: {_FIXES.get(path.name, 'restore or delete it')}") from None


def orchestrator_alive(info: dict[str, Any]) -> bool:
    """Whether the process named in ``orchestrator.json`` exists (True on another host: there
    only the snapshot's age can tell)."""
    if info.get("host") != socket.gethostname():
        return True
    return pid_alive(int(info["pid"]))


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
    def starting(self) -> bool:
        """The orchestrator runs and has not written its first status yet (it starts the Dask
        scheduler, waits for its workers, builds the components)."""
        return bool(self.info) and self.status is None and self.summary is None and orchestrator_alive(self.info)

    def starting_message(self, run_dir: Path | str, info: dict[str, Any] | None = None) -> str:
        info = self.info if info is None else info
        since = time.time() - float(info.get("started", time.time()))
        if info.get("unverified"):  # on another host: whether it still runs cannot be told from here
            return (f"the run directory {run_dir} is held by an `astraflow run` on {info.get('host')} (pid "
                    f"{info.get('pid')}, since {since:.0f}s ago): a resume is likely starting there (or that "
                    "process was killed before it let go); ask again shortly")
        job = f", Slurm job {info['slurm_job']}" if info.get("slurm_job") else ""
        return (f"the run in {run_dir} is starting (orchestrator pid {info.get('pid')} on "
                f"{info.get('host')}{job}, for {since:.0f}s): its first status comes once its workers have "
                "joined and its components are built; ask again shortly")

    def new_incarnation(self) -> dict[str, Any]:
        """The ``astraflow run`` that holds the directory's lock (``control/run.lock``: pid, host,
        start) when it is alive on this host and is not the orchestrator of ``orchestrator.json``:
        a resume that has not written its own yet (the earlier one's files are still there); on
        another host, one that started after that orchestrator, marked ``unverified``; else {}."""
        from astraflow.runtime.runlock import holder_of

        holder = holder_of(self.paths.root)
        if "pid" not in holder:
            return {}
        if holder.get("host") != socket.gethostname():  # a newer start than the orchestrator file's, maybe alive
            newer = float(holder.get("started", 0)) > float(self.info.get("started", 0))
            return {**holder, "unverified": True} if newer else {}
        if not orchestrator_alive(holder) or holder.get("pid") == self.info.get("pid"):
            return {}
        return holder

    def gone_before_first_status(self) -> dict[str, Any]:
        """The `astraflow run` (pid, host, start) of a directory with no status and no summary whose
        process is gone from this host: killed while it started (its orchestrator file or its
        lock names it); {} otherwise."""
        if self.status is not None or self.summary is not None:
            return {}
        from astraflow.runtime.runlock import holder_of

        for who in (self.info, holder_of(self.paths.root)):
            if who.get("pid") and who.get("host") == socket.gethostname() and not pid_alive(int(who["pid"])):
                return who
        return {}

    def gone_message(self, run_dir: Path | str, who: dict[str, Any]) -> str:
        since = time.time() - float(who.get("started", time.time()))
        return (f"the run in {run_dir} stopped before its first status: its `astraflow run` (pid {who.get('pid')} "
                f"on {who.get('host')}, started {since:.0f}s ago) is gone without a summary (killed?); its output "
                f"and {self.paths.logs} say why; `astraflow run` on the run directory starts it again")

    @property
    def stale(self) -> bool:
        """A snapshot exists and its writer stopped writing it: long ago, or its orchestrator is
        gone (killed: no need to wait out the age)."""
        gone = not (self.info and orchestrator_alive(self.info))
        return self.status is not None and (gone or self.age_s is None or self.age_s > STALE_AFTER_S)


def damaged_run_files(run_dir: Path | str, err: Exception) -> UnreadableFile:
    """The error for status files that parse but hold a field of a type no writer writes."""
    paths = RunPaths(Path(run_dir))
    return UnreadableFile(f"{paths.status_file} or {paths.summary} is damaged (a field of an unexpected type: "
                          f"{type(err).__name__}: {err}): restore it from a backup, or delete control/status.json "
                          "(it is rewritten while the run runs)")


def read_snapshot(run_dir: Path | str, now: float | None = None) -> Snapshot:
    """The status files of the run in ``run_dir`` (any of them may be missing)."""
    paths = RunPaths(Path(run_dir))
    now = time.time() if now is None else now
    status = _read_json(paths.status_file, _STATUS)
    info = _read_json(paths.orchestrator_file, _INFO) or {}
    written = status.get("written_at") if status is not None else None
    started = info.get("started")
    if written is not None and started is not None and float(written) < float(started):
        status, written = None, None  # the previous incarnation's: this one has not written one yet
    return Snapshot(paths=paths, status=status, summary=_read_json(paths.summary), info=info,
                    age_s=(now - written) if written is not None else None)


def run_status(run_dir: Path, require_running: bool = True) -> dict[str, Any]:
    """The latest status snapshot of the run in ``run_dir``, with ``running`` and
    ``orchestrator`` (its ``orchestrator.json``) added. Raises `RunNotRunning` with what to do
    when there is no snapshot, or (``require_running``) when the run is not running."""
    paths = RunPaths(run_dir)
    if not paths.root.is_dir():
        raise RunNotRunning(f"{run_dir} is not a run directory: pass the --run-dir of `astraflow run`")
    snap = read_snapshot(run_dir)
    if snap.starting:
        raise RunNotRunning(snap.starting_message(run_dir))
    if not snap.running and (resuming := snap.new_incarnation()):
        raise RunNotRunning(snap.starting_message(run_dir, resuming))
    if gone := snap.gone_before_first_status():
        raise RunNotRunning(snap.gone_message(run_dir, gone))
    if not paths.orchestrator_file.exists() or snap.status is None:
        if paths.summary.exists():
            raise RunNotRunning(f"the run in {run_dir} has finished; its final state is in {paths.summary}")
        raise RunNotRunning(f"no run has started in {run_dir} yet (no {paths.status_file.name})")
    status = dict(snap.status or {})
    status["running"] = snap.running
    status["orchestrator"] = snap.info
    if require_running and not snap.running:
        hint = f"its final state is in {paths.summary}" if snap.finished else "it stopped without a summary"
        raise RunNotRunning(f"the run in {run_dir} is not running ({hint})")
    return status
