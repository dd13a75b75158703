"""SlurmScheduler against a real (local) Slurm and a real Dask scheduler on 127.0.0.1."""

from __future__ import annotations

import time
import uuid

import pytest

from schedulers import Partition, UnknownJobError, make_scheduler
from schedulers.slurm import SlurmCommandError, SlurmScheduler, run_slurm
from tests.schedulers.dask_fixtures import connected_workers, wait_for_workers

pytestmark = pytest.mark.slurm


@pytest.fixture
def sched(tmp_path):
    s = SlurmScheduler(tmp_path / "jobs", interface="lo", tag=f"aftest-{uuid.uuid4().hex[:8]}", death_timeout=30)
    yield s
    left = [j.job_id for j in s.jobs() if j.active]
    if left:
        s.cancel(left)


def _gpu() -> Partition:
    return Partition(name="h100", scheduler="slurm", slurm_partition="h100", nodes=2, gres="gpu:h100:1",
                     gpus_per_node=1, region="eu", hardware="H100", role="rollout", walltime="00:10:00", mem="512M")


def _cpu() -> Partition:
    return Partition(name="cpu", scheduler="slurm", slurm_partition="cpu", nodes=1, region="us", hardware="cpu",
                     role="data", walltime="10")


@pytest.mark.timeout(90)
def test_workers_in_two_partitions_join_by_name_and_cancel(sched, dask_scheduler):
    address, sched_file, client = dask_scheduler
    refs = sched.submit(_gpu(), address, count=2) + sched.submit(_cpu(), str(sched_file), count=1)
    names = {r.worker_name for r in refs}
    assert names == {"rollout-h100-eu-H100-0", "rollout-h100-eu-H100-1", "data-cpu-us-cpu-0"}
    assert all(r.script.exists() for r in refs)

    running = sched.wait_for([r.job_id for r in refs], {"RUNNING"}, deadline_s=30)
    nodes = {s.worker_name: s.node for s in running.values()}
    assert nodes["data-cpu-us-cpu-0"] == "cpu-1"
    assert {nodes["rollout-h100-eu-H100-0"], nodes["rollout-h100-eu-H100-1"]} <= {"h100-1", "h100-2"}
    assert {s.partition for s in running.values()} == {"h100", "cpu"}

    connected = wait_for_workers(client, names, present=True, deadline_s=45)
    assert names <= connected, f"not joined: {names - connected}; logs: " + " | ".join(
        r.log.read_text()[-400:] for r in refs if r.log.exists())
    resources = {w["name"]: w["resources"] for w in connected_workers(client).values()}
    assert resources["rollout-h100-eu-H100-1"] == {"rollout": 1, "GPU": 1}
    assert resources["data-cpu-us-cpu-0"] == {"data": 1}
    # the job really got the GRES it asked for
    env = client.run(lambda: __import__("os").environ.get("SLURM_JOB_GPUS"), workers=[
        w for w, i in connected_workers(client).items() if i["name"] == "rollout-h100-eu-H100-0"])
    assert list(env.values()) != [None]

    gone = refs[0]
    sched.cancel([gone.job_id])
    sched.wait_for([gone.job_id], {"CANCELLED"}, deadline_s=20)
    left = wait_for_workers(client, {gone.worker_name}, present=False, deadline_s=20)
    assert gone.worker_name not in left and names - {gone.worker_name} <= left
    states = {s.job_id: s.state for s in sched.jobs()}
    assert states[gone.job_id] == "CANCELLED" and states[refs[1].job_id] == "RUNNING"

    sched.cancel([r.job_id for r in refs[1:]], wait=True)  # returns once Slurm lists none active
    assert not [s for s in sched.jobs() if s.job_id in {r.job_id for r in refs} and s.active]
    sched.wait_for([r.job_id for r in refs], {"CANCELLED"}, deadline_s=20)
    assert wait_for_workers(client, names, present=False, deadline_s=20).isdisjoint(names)


@pytest.mark.timeout(30)
def test_bad_partition_raises_with_exit_code_and_stderr(sched):
    bad = Partition(name="x", scheduler="slurm", slurm_partition="nosuch")
    with pytest.raises(SlurmCommandError) as info:
        sched.submit(bad, "tcp://127.0.0.1:1", 1)
    err = info.value
    assert err.returncode == 1 and err.cmd[:2] == ["sbatch", "--parsable"]
    assert "invalid partition" in err.stderr.lower()
    assert sched.jobs() == []


@pytest.mark.timeout(30)
def test_cancel_unknown_id_is_detected(sched):
    # scancel itself exits 0 for an unknown id; the scheduler confirms with squeue
    run_slurm(["scancel", "987654"])
    with pytest.raises(UnknownJobError, match="987654"):
        sched.cancel(["987654"])
    with pytest.raises(ValueError, match="digits"):
        sched.cancel(["--all"])
    with pytest.raises(SlurmCommandError) as info:
        run_slurm(["squeue", "-j", "987654"])
    assert info.value.returncode == 1 and "Invalid job id" in info.value.stderr


@pytest.mark.timeout(30)
def test_sinfo_and_factory(tmp_path):
    s = make_scheduler("slurm", job_dir=tmp_path)
    assert s.kind == "slurm" and s.supports_gres and s.ping()
    parts = {p for n in s.nodes() for p in n.partitions}
    assert {"h100", "a100", "cpu"} <= parts, "local_slurm.sh makes h100, a100 and cpu partitions"


def _listed(job_id: str) -> dict:
    import json

    return next(j for j in json.loads(run_slurm(["squeue", "--json", "--states=all"]))["jobs"]
                if str(j["job_id"]) == job_id)


@pytest.mark.timeout(90)
def test_sbatch_variables_of_the_users_environment_do_not_replace_the_partitions_settings(sched, monkeypatch):
    """sbatch ranks SBATCH_* variables above the script's lines: a personal default partition,
    time limit or job name would silently move, shorten or hide every worker job."""
    monkeypatch.setenv("SBATCH_PARTITION", "h100")
    monkeypatch.setenv("SBATCH_TIMELIMIT", "5")
    monkeypatch.setenv("SBATCH_JOB_NAME", "my-default-name")
    (ref,) = sched.submit(_cpu(), "tcp://127.0.0.1:9", 1)
    job = _listed(ref.job_id)
    assert (job["partition"], job["time_limit"]) == ("cpu", 10)
    assert ref.job_id in {j.job_id for j in sched.jobs()}


@pytest.mark.timeout(90)
def test_the_users_jobs_are_found_by_uid_whatever_user_says(sched, monkeypatch):
    (ref,) = sched.submit(_cpu(), "tcp://127.0.0.1:9", 1)
    monkeypatch.setenv("LOGNAME", "alice")  # `su` from alice's shell, a container, a CI runner
    monkeypatch.setenv("USER", "alice")
    assert ref.job_id in {j.job_id for j in sched.jobs()}


@pytest.mark.timeout(90)
def test_an_sbatch_that_timed_out_after_submitting_leaves_no_job_behind(sched, tmp_path, monkeypatch):
    """A slow controller: sbatch submits the job but answers after the scheduler gave up. The job
    would run on with the run's tag, tracked by nobody: it is found by name and cancelled."""
    import os
    import shutil
    import stat

    real = shutil.which("sbatch")
    slow = tmp_path / "bin" / "sbatch"
    slow.parent.mkdir()
    slow.write_text(f'#!/bin/sh\n{real} "$@"\nrc=$?\nsleep 4\nexit $rc\n')
    slow.chmod(slow.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{slow.parent}{os.pathsep}{os.environ['PATH']}")
    sched.command_timeout = 1.5
    with pytest.raises(SlurmCommandError) as err:
        sched.submit(_cpu(), "tcp://127.0.0.1:9", 1)
    assert err.value.returncode == 124
    assert any("anyway: cancelled job(s)" in note for note in getattr(err.value, "__notes__", []))
    sched.command_timeout = 30.0
    deadline = time.monotonic() + 30
    while [j for j in sched.jobs() if j.active and j.raw_state != "COMPLETING"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [j for j in sched.jobs() if j.active and j.raw_state != "COMPLETING"]


@pytest.mark.timeout(90)
def test_the_same_worker_of_two_runs_has_job_names_squeue_tells_apart(sched, tmp_path):
    """A user's sweep: two runs submit worker 0 of the same partition. ``squeue`` (names, not
    comments) lists them under different names, and each run's `jobs()` finds its own only."""
    import json

    other = SlurmScheduler(tmp_path / "other" / "jobs", interface="lo", tag=f"aftest-{uuid.uuid4().hex[:8]}")
    try:
        (mine,) = sched.submit(_cpu(), "tcp://127.0.0.1:9", 1)
        (theirs,) = other.submit(_cpu(), "tcp://127.0.0.1:9", 1)
        assert mine.worker_name == theirs.worker_name == "data-cpu-us-cpu-0"
        listed = {str(j["job_id"]): j["name"] for j in json.loads(run_slurm(["squeue", "--json"]))["jobs"]}
        assert listed[mine.job_id] != listed[theirs.job_id]
        assert sched.tag in listed[mine.job_id] and other.tag in listed[theirs.job_id]
        ours = {j.job_id: j.worker_name for j in sched.jobs()}
        assert ours == {mine.job_id: "data-cpu-us-cpu-0"}
    finally:
        left = [j.job_id for j in other.jobs() if j.active]
        if left:
            other.cancel(left)
