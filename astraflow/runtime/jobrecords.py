"""Runtime room: the worker jobs of a run's previous incarnation are cancelled, never orphaned.

A run directory is run again after its orchestrator crashed, was killed (SIGKILL, out of
memory), lost its node, or stopped for a requeue. Worker jobs the previous incarnation
submitted may still be queued or running then, pointing at a Dask scheduler that is gone; a
queued one would even join the new scheduler under a worker name the new incarnation uses.

So every job a run submits is recorded in ``jobs/submitted.json`` (`JobRecords`, written
atomically and durably as soon as it is submitted), and a new incarnation, once it holds the
run lock (no live orchestrator uses the directory), hands the records to each backend's
``cancel_previous`` (`cancel_previous_jobs`). A backend cancels only what it can verify is still
that job: Slurm finds the run's jobs by their tag, a local worker is signalled only while its
pid has the recorded identity. A job submitted but not yet recorded when its orchestrator died
is still found on Slurm by its tag; a local one dies with its orchestrator
(`schedulers.procs.die_with_parent`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from schedulers import JobRef, Partition
from storage.atomic import UnreadableFile, read_json_object, write_json
from storage.paths import RunPaths

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig
    from astraflow.runtime.progress import Progress

log = logging.getLogger("astraflow.runtime")


def _to_json(ref: JobRef) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(ref).items()}


def _from_json(entry: Any) -> JobRef | None:
    """The `JobRef` of one record, or None for an entry that is not one (a damaged file)."""
    try:
        ref = JobRef(**entry)
    except TypeError:
        return None
    if not all(isinstance(getattr(ref, k), str) for k in ("job_id", "partition", "worker_name", "kind")):
        return None
    return JobRef(ref.job_id, ref.partition, ref.worker_name, ref.kind,
                  Path(ref.log) if ref.log else None, Path(ref.script) if ref.script else None,
                  ref.identity if isinstance(ref.identity, str) else None)


def read_job_records(paths: RunPaths) -> list[JobRef]:
    """The jobs recorded in the run directory (empty when there are none). Entries of a damaged
    file that are not job records are skipped with a warning: what is left is still cancelled."""
    if not paths.job_records.exists():
        return []
    try:
        entries = read_json_object(paths.job_records).get("jobs", [])
    except UnreadableFile as err:
        log.warning("%s; the jobs it recorded cannot be cancelled from it", err)
        return []
    refs = [_from_json(e) for e in entries] if isinstance(entries, list) else [None]
    if None in refs:
        log.warning("%s: skipped %d entries that are not job records", paths.job_records, refs.count(None))
    return [r for r in refs if r is not None]


class JobRecords:
    """The jobs submitted by this incarnation (plus any the previous cleanup could not settle),
    rewritten atomically and durably on every `add`: submissions are rare, and a record lost in
    a crash of the head node would be a job nobody cancels."""

    def __init__(self, paths: RunPaths):
        self.paths = paths
        self.refs: list[JobRef] = read_job_records(paths)

    def add(self, refs: Iterable[JobRef]) -> None:
        new = list(refs)
        if new:
            self.refs.extend(new)
            write_json(self.paths.job_records, {"jobs": [_to_json(r) for r in self.refs]}, indent=1)


@dataclass
class PreviousJobs:
    """What the cleanup at start found; written into ``status.json`` and ``summary.json`` as
    ``previous_jobs``."""

    cancelled: list[dict[str, Any]] = field(default_factory=list)
    """One entry per job of a previous incarnation that was still active and is now cancelled:
    ``job_id``, ``kind``, ``worker``, ``partition``, ``state`` it had, ``node``."""
    errors: dict[str, str] = field(default_factory=dict)
    """Backend kind -> why its jobs could not be checked (they are checked again next time)."""

    def as_dict(self) -> dict[str, Any]:
        return {"cancelled": self.cancelled, "errors": self.errors}


def cancel_previous_jobs(paths: RunPaths, cluster: ClusterConfig, partitions: Iterable[Partition],
                         progress: Progress) -> PreviousJobs:
    """Cancel the worker jobs a previous incarnation of the run in `paths` left active. Call it
    only while holding the run lock, before this incarnation submits anything.

    Asks each backend that recorded jobs, and each backend of `partitions` (the config's) or of
    the previous incarnation's desired partitions (added mid-run), so Slurm is asked by tag even
    when no record survived. One progress line per cancelled job. Records of a backend that
    could not be asked (Slurm not answering) are kept for the next incarnation; the others are
    settled and dropped."""
    from astraflow.runtime.control import PartitionError, read_desired_file
    from astraflow.runtime.reconcile import run_scheduler
    from astraflow.runtime.workers import RunFailed
    from schedulers.slurm import SlurmCommandError, SlurmWaitTimeout

    records = read_job_records(paths)
    try:
        desired = list(read_desired_file(paths)[0].values())
    except PartitionError:  # damaged: the records and the config still name the backends
        desired = []
    kinds = {r.kind for r in records} | {p.scheduler for p in [*partitions, *desired]}
    found = PreviousJobs()
    for kind in sorted(kinds):
        mine = [r for r in records if r.kind == kind]
        try:
            stale = run_scheduler(kind, paths, cluster, None).cancel_previous(mine)
        except SlurmWaitTimeout as err:  # cancelled, and may still write into the run directory
            raise RunFailed(f"{kind} jobs of a previous incarnation of this run were cancelled but have not "
                            f"ended ({err}): run again once `squeue --me` no longer lists them") from None
        except (SlurmCommandError, OSError) as err:
            found.errors[kind] = f"{type(err).__name__}: {err}"
            progress.note(f"could not check for {kind} jobs left by a previous incarnation of this run: "
                          f"{found.errors[kind]}")
            continue
        for job in stale:
            found.cancelled.append({"job_id": job.job_id, "kind": kind, "worker": job.worker_name,
                                    "partition": job.partition, "state": job.state, "node": job.node})
            progress.note(f"cancelled {kind} job {job.job_id} ({job.worker_name}, {job.state}"
                          f"{f' on {job.node}' if job.node else ''}) left by a previous incarnation of this run")
    kept = [r for r in records if r.kind in found.errors]
    if kept:
        write_json(paths.job_records, {"jobs": [_to_json(r) for r in kept]}, indent=1)
    else:
        paths.job_records.unlink(missing_ok=True)
    return found
