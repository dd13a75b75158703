"""Elastic job-scheduler backends: where AstraFlow's Dask workers come from.

`Partition` describes a pool; `Scheduler` (Protocol) starts/stops/lists its workers;
`LocalScheduler` runs them as subprocesses, `SlurmScheduler` as Slurm jobs. This package never
imports `astraflow`.
"""

from schedulers.base import (
    ACTIVE_STATES,
    JOB_STATES,
    JobRef,
    JobState,
    JobStatus,
    Scheduler,
    UnknownJobError,
    make_scheduler,
)
from schedulers.command import partition_worker_command, worker_command, worker_env
from schedulers.tls import TLSConfig, TLSFiles
from schedulers.local import LocalScheduler
from schedulers.partition import Partition, parse_worker_name, walltime_seconds, worker_name

__all__ = [
    "ACTIVE_STATES",
    "JOB_STATES",
    "JobRef",
    "JobState",
    "JobStatus",
    "LocalScheduler",
    "Partition",
    "Scheduler",
    "UnknownJobError",
    "make_scheduler",
    "parse_worker_name",
    "TLSConfig",
    "TLSFiles",
    "partition_worker_command",
    "walltime_seconds",
    "worker_command",
    "worker_env",
    "worker_name",
]
