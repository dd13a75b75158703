"""The boundary between the orchestrator and whatever starts worker processes.

The orchestrator reconciles a desired set of `Partition`s with the workers that exist. It needs
only four operations from a job scheduler: start N workers of a partition, stop some of them,
list them all in one call, and, when a run resumes, cancel what its previous incarnation left.
`Scheduler` is that Protocol; `LocalScheduler` (subprocesses) and `SlurmScheduler`
(sbatch/squeue/scancel) implement it, and `make_scheduler` picks one by kind.

Every worker runs the same command line (`schedulers.command.worker_command`), so a worker
started by Slurm and one started locally join the Dask scheduler the same way, under a name
from `schedulers.partition.worker_name`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, Protocol, Sequence, get_args, runtime_checkable

from schedulers.partition import Partition

JobState = Literal["PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "UNKNOWN"]
JOB_STATES: tuple[str, ...] = get_args(JobState)
ACTIVE_STATES: frozenset[str] = frozenset({"PENDING", "RUNNING"})
"""States of a job that holds (or will hold) a worker; the rest are final (UNKNOWN excepted)."""


class UnknownJobError(ValueError):
    """`cancel` was given job ids that this scheduler never started and cannot see."""

    def __init__(self, job_ids: list[str], kind: str):
        self.job_ids = job_ids
        super().__init__(
            f"{kind} scheduler knows no job(s) {', '.join(job_ids)}: pass ids returned by submit() or listed by jobs()"
        )


@dataclass(frozen=True)
class JobRef:
    """A worker job just submitted. Written by `Scheduler.submit`; read by the orchestrator,
    which keeps `job_id` to cancel it and `worker_name` to place an actor on it once it joins."""

    job_id: str
    """Backend id: the Slurm job id (``"1234"``) or ``"local-<pid>"``."""
    partition: str
    """`Partition.name` of the pool the worker belongs to."""
    worker_name: str
    """The Dask worker name the process will register with (see `worker_name`)."""
    kind: str
    """Backend that started it: ``"local"`` or ``"slurm"``."""
    log: Path | None
    """File receiving the worker's stdout/stderr (None if the backend does not know it yet)."""
    script: Path | None = None
    """Rendered job script (Slurm); None for local workers."""
    identity: str | None = None
    """What shows that the job's process is still this job when its id can name another one
    later: a local worker's `schedulers.procs.process_identity` (host, boot id, start time of
    its pid). None for Slurm jobs (a run finds its own by their ``--comment`` tag)."""


@dataclass(frozen=True)
class JobStatus:
    """One worker job as the backend sees it now. Written by `Scheduler.jobs`; read by the
    orchestrator's reconcile loop and by `astraflow status`."""

    job_id: str
    """Backend id, as in `JobRef.job_id`."""
    partition: str
    """`Partition.name` the job belongs to (parsed from the worker name)."""
    worker_name: str
    """Dask worker name of the job."""
    state: JobState
    """Normalised state: PENDING (queued/starting), RUNNING, COMPLETED (exited with 0),
    FAILED (non-zero exit, signal, timeout, node failure), CANCELLED (by `cancel` or a user),
    UNKNOWN (a backend state with no mapping; see `reason`)."""
    reason: str | None = None
    """Why it is in that state (Slurm's reason, an exit code); None when there is nothing to say."""
    raw_state: str | None = None
    """The backend's own state string (e.g. Slurm's ``CONFIGURING``); None for local jobs."""
    node: str | None = None
    """Host/node the job runs on; None while pending or when unknown."""

    @property
    def active(self) -> bool:
        """True while the job holds or will hold a worker (PENDING or RUNNING)."""
        return self.state in ACTIVE_STATES


@runtime_checkable
class Scheduler(Protocol):
    """Starts, stops and lists Dask worker jobs for partitions."""

    @property
    def kind(self) -> str:
        """``"local"`` or ``"slurm"``: the `Partition.scheduler` value this backend serves."""
        ...

    @property
    def supports_gres(self) -> bool:
        """Whether `Partition.gres` / Slurm options can be honoured."""
        ...

    def submit(self, partition: Partition, scheduler_address: str, count: int, start_index: int = 0) -> list[JobRef]:
        """Start `count` workers named ``worker_name(partition, start_index + i)``.

        `scheduler_address` is ``tcp://host:port`` or the path of a Dask scheduler file
        (``<run>/scheduler.json``). Returns once the jobs are submitted, not once they joined.
        """
        ...

    def cancel(self, job_ids: Iterable[str], wait: bool = False) -> None:
        """Stop these jobs (killing the worker kills its actors). Finished jobs are a no-op;
        ids the backend never saw raise `UnknownJobError` after the others are cancelled. With
        ``wait``, return only once their processes are gone (a cancelled job can run on for a
        while, and one replaced must not write into the run meanwhile)."""
        ...

    def jobs(self) -> list[JobStatus]:
        """Every job this scheduler started (and, for Slurm, every job with its tag), one batched query."""
        ...

    def cancel_previous(self, records: Sequence[JobRef]) -> list[JobStatus]:
        """Cancel the jobs a previous incarnation of this run started that are still active,
        and return them as they were. `records` are the `JobRef`s that incarnation recorded;
        a job is cancelled only when the backend can verify it is still that job (a reused pid
        or job id is left alone). Returns once they ended (their processes are gone). Call it
        before this incarnation submits anything."""
        ...

    def close(self) -> None:
        """Release what the backend itself holds, at shutdown (after ``cancel``)."""
        ...


def make_scheduler(kind: str, **kwargs: Any) -> Scheduler:
    """Build the scheduler backend for `kind` (``local`` or ``slurm``) with its keyword options."""
    if kind == "local":
        from schedulers.local import LocalScheduler

        return LocalScheduler(**kwargs)
    if kind == "slurm":
        from schedulers.slurm import SlurmScheduler

        return SlurmScheduler(**kwargs)
    raise ValueError(f"unknown scheduler kind {kind!r}: known kinds are 'local', 'slurm'")
