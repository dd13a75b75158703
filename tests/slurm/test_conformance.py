"""One conformance suite for the `Scheduler` protocol, run against every backend.

The local backend always runs; the Slurm one needs the local Slurm cluster (marked `slurm`).
"""

from __future__ import annotations

import uuid

import pytest

from schedulers import Partition, Scheduler, make_scheduler
from tests.schedulers.dask_fixtures import wait_for_workers

BACKENDS = ["local", pytest.param("slurm", marks=pytest.mark.slurm)]


def _backend(kind: str, tmp_path) -> tuple[Scheduler, Partition]:
    if kind == "local":
        return make_scheduler("local", log_dir=tmp_path / "logs", death_timeout=20), Partition(name="pool", role="trainer")
    sched = make_scheduler("slurm", job_dir=tmp_path / "jobs", interface="lo", death_timeout=20,
                           tag=f"conf-{uuid.uuid4().hex[:8]}")
    return sched, Partition(name="pool", scheduler="slurm", slurm_partition="a100", role="trainer", walltime="5")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", BACKENDS)
def test_scheduler_contract(kind, tmp_path, dask_scheduler):
    address, _, client = dask_scheduler
    sched, part = _backend(kind, tmp_path)
    assert isinstance(sched, Scheduler) and sched.kind == kind
    assert sched.submit(part, address, count=0) == []
    refs = sched.submit(part, address, count=2, start_index=5)
    assert [r.worker_name for r in refs] == ["trainer-pool-local-cpu-5", "trainer-pool-local-cpu-6"]
    assert len({r.job_id for r in refs}) == 2 and all(r.kind == kind and r.partition == "pool" for r in refs)
    names = {r.worker_name for r in refs}
    try:
        assert names <= wait_for_workers(client, names, present=True, deadline_s=45)
        listed = {s.job_id: s for s in sched.jobs()}
        assert set(listed) == {r.job_id for r in refs}
        assert all(s.state == "RUNNING" and s.active and s.partition == "pool" for s in listed.values())
    finally:
        sched.cancel([r.job_id for r in refs])
    assert wait_for_workers(client, names, present=False, deadline_s=30).isdisjoint(names)
    if kind == "slurm":  # cancellation is asynchronous in Slurm
        sched.wait_for([r.job_id for r in refs], {"CANCELLED"}, deadline_s=20)
    assert {s.state for s in sched.jobs()} == {"CANCELLED"}
    sched.cancel([refs[0].job_id])  # cancelling a finished job is a no-op
