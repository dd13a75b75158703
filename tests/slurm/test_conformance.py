"""One conformance suite for the `Scheduler` protocol, run against every backend.

The local backend always runs; the Slurm one needs the local Slurm cluster (marked `slurm`).
"""

from __future__ import annotations

import uuid

import pytest

from schedulers import Partition, Scheduler, make_scheduler
from tests.schedulers.dask_fixtures import wait_for_workers

BACKENDS = ["local", pytest.param("slurm", marks=pytest.mark.slurm)]


def _backend(kind: str, tmp_path, tag: str | None = None) -> tuple[Scheduler, Partition]:
    if kind == "local":
        return make_scheduler("local", log_dir=tmp_path / "logs", death_timeout=20), Partition(name="pool", role="trainer")
    sched = make_scheduler("slurm", job_dir=tmp_path / "jobs", interface="lo", death_timeout=20,
                           tag=tag or f"conf-{uuid.uuid4().hex[:8]}")
    return sched, Partition(name="pool", scheduler="slurm", slurm_partition="a100", role="trainer", walltime="5")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", BACKENDS)
def test_scheduler_contract(kind, tmp_path, dask_scheduler):
    address, _, client = dask_scheduler
    sched, part = _backend(kind, tmp_path)
    assert isinstance(sched, Scheduler) and sched.kind == kind
    assert sched.submit(part, address, count=0) == []
    refs = sched.submit(part, address, count=2, start_index=5)
    names = {r.worker_name for r in refs}
    try:  # the workers are cancelled whichever check fails
        assert [r.worker_name for r in refs] == ["trainer-pool-local-cpu-5", "trainer-pool-local-cpu-6"]
        assert len({r.job_id for r in refs}) == 2 and all(r.kind == kind and r.partition == "pool" for r in refs)
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


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", BACKENDS)
def test_a_new_incarnation_cancels_what_the_previous_one_left(kind, tmp_path, dask_scheduler):
    """A second backend object for the same run (a resumed run's) cancels the first one's live
    jobs from their records and reports them; the first object's view agrees they ended."""
    address, _, client = dask_scheduler
    tag = f"conf-{uuid.uuid4().hex[:8]}"
    old, part = _backend(kind, tmp_path, tag)
    refs = old.submit(part, address, count=1)
    try:
        assert {r.worker_name for r in refs} <= wait_for_workers(client, {r.worker_name for r in refs}, True, 45)
        new, _ = _backend(kind, tmp_path, tag)
        stale = new.cancel_previous(refs)
        assert [(s.job_id, s.worker_name, s.partition) for s in stale] == [(r.job_id, r.worker_name, "pool") for r in refs]
        assert all(s.state == "RUNNING" for s in stale)
        assert wait_for_workers(client, {r.worker_name for r in refs}, False, 30).isdisjoint({r.worker_name for r in refs})
        if kind == "slurm":  # cancellation is asynchronous in Slurm
            new.wait_for([r.job_id for r in refs], {"CANCELLED"}, deadline_s=20)
        assert new.cancel_previous(refs) == []  # nothing active is left
    finally:
        old.cancel([r.job_id for r in refs])
