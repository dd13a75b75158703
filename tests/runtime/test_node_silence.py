"""Which RaaS nodes the orchestrator replaces (``Fleet.replace_failed_nodes``): one that reported
an error at once; one whose loop went silent past the lease time only when it is silent on two
checks in a row (a data layer that was itself stalled can answer before it has read the
heartbeats queued meanwhile); one that stopped on a full disk, or could not start on one, not
at all: the run stops.

The process boundaries are stood in for: the data-layer actor handle (``node_gone``) and the
job system (``cancel``, recorded); the fleet and its partitions are real."""

from __future__ import annotations

import concurrent.futures
import errno
import time

import pytest

from astraflow.config import ClusterConfig
from astraflow.runtime.progress import Progress
from astraflow.runtime.reconcile import PartitionSet
from astraflow.runtime.stopping import disk_full
from astraflow.runtime.workers import Fleet
from schedulers import JobRef, Partition
from storage.paths import RunPaths

LEASE_S = 5.0


class _DataLayer:
    def __init__(self):
        self.gone: list[str] = []

    def node_gone(self, name):
        self.gone.append(name)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(0)
        return fut


class _Jobs:
    def __init__(self):
        self.cancelled: list[str] = []

    def cancel(self, ids, wait=False):
        self.cancelled += ids

    def jobs(self):
        return []


class _Placement:
    def __init__(self, fleet):
        self.fleet = fleet

    def joined(self):
        return {name: "tcp://127.0.0.1:1" for name in self.fleet.workers}


def _fleet(tmp_path) -> tuple[Fleet, _DataLayer]:
    parts = [Partition(name="rollout", role="rollout", nodes=2)]
    progress = Progress(enabled=False)
    fleet = Fleet(PartitionSet(parts, RunPaths(tmp_path / "run"), ClusterConfig(), progress), placement=None,
                  cluster=ClusterConfig(), progress=progress, place_node=lambda n, p: None)
    for i in range(2):
        w = fleet.add(JobRef(job_id=f"local-{900 + i}", partition="rollout", worker_name=f"rollout-{i}",
                             kind="local", log=None), "rollout")
        w.enter("serving")
        w.since = time.time() - 10 * LEASE_S
    fleet.dl, fleet.parts.schedulers["local"] = _DataLayer(), _Jobs()
    return fleet, fleet.dl


def _state(**nodes) -> dict:
    return {"nodes": {name: {"worker": name, "error": None, "silent_s": 0.5, **r} for name, r in nodes.items()}}


def test_silence_counts_on_two_checks_in_a_row_and_an_error_at_once(tmp_path):
    fleet, dl = _fleet(tmp_path)
    silent = {"rollout-0": {"silent_s": 3 * LEASE_S}, "rollout-1": {}}
    fleet.replace_failed_nodes(_state(**silent), LEASE_S)
    assert dl.gone == []  # the data layer may have been away itself: not yet
    fleet.replace_failed_nodes(_state(**{"rollout-0": {}, "rollout-1": {}}), LEASE_S)  # its heartbeats arrived
    fleet.replace_failed_nodes(_state(**silent), LEASE_S)
    assert dl.gone == []  # silent once again after a heartbeat: the count starts over
    fleet.replace_failed_nodes(_state(**silent), LEASE_S)
    assert dl.gone == ["rollout-0"] and fleet.workers["rollout-0"].phase == "gone"
    assert fleet.parts.schedulers["local"].cancelled == ["local-900"]
    assert "has not called the data layer" in fleet.workers["rollout-0"].note

    fleet.replace_failed_nodes(_state(**{"rollout-1": {"error": "RuntimeError: boom"}}), LEASE_S)
    assert dl.gone == ["rollout-0", "rollout-1"] and "RuntimeError: boom" in fleet.workers["rollout-1"].note


def test_a_node_on_a_full_disk_stops_the_run_instead_of_being_replaced(tmp_path):
    fleet, dl = _fleet(tmp_path)
    full = {"error": "OSError: [Errno 28] No space left on device", "error_os": (errno.ENOSPC, "/x/seg/c0")}
    with pytest.raises(OSError) as err:
        fleet.replace_failed_nodes(_state(**{"rollout-0": full, "rollout-1": {}}), LEASE_S)
    assert disk_full(err.value) and err.value.filename == "/x/seg/c0"
    assert dl.gone == [] and fleet.workers["rollout-0"].phase == "serving"


def test_a_node_that_cannot_start_on_a_full_disk_stops_the_run(tmp_path):
    fleet, dl = _fleet(tmp_path)
    fleet.placement = _Placement(fleet)
    for i, err in enumerate((OSError(errno.ENOSPC, "No space left on device", "/x/seg"), RuntimeError("boom"))):
        w = fleet.workers[f"rollout-{i}"]
        w.joined_at = time.time()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_exception(err)
        w.enter("starting", fut)
    with pytest.raises(OSError) as raised:
        fleet.advance()
    assert disk_full(raised.value) and fleet.workers["rollout-0"].phase == "starting"
    fleet.workers["rollout-0"].enter("serving")
    fleet.advance()  # any other start error: the node is replaced
    assert fleet.workers["rollout-1"].phase == "gone" and "boom" in fleet.workers["rollout-1"].note


def test_a_job_listing_that_fails_keeps_the_last_one_until_the_grace_runs_out(tmp_path, monkeypatch):
    from astraflow.runtime import workers
    from astraflow.runtime.workers import RunFailed
    from schedulers import JobStatus
    from schedulers.slurm import SlurmCommandError

    fleet, _ = _fleet(tmp_path)
    jobs = fleet.parts.schedulers["local"]
    listed = [JobStatus(f"local-{900 + i}", "rollout", f"rollout-{i}", "RUNNING", None, None, "localhost")
              for i in range(2)]
    jobs.jobs = lambda: listed
    fleet.poll_jobs()

    def busy():
        raise SlurmCommandError(["squeue"], 1, "", "slurm_load_jobs error: Socket timed out on send/recv operation")

    jobs.jobs = busy
    fleet.poll_jobs()  # a busy controller: the last listing stands
    assert {j: s.state for j, s in fleet.jobs.items()} == {"local-900": "RUNNING", "local-901": "RUNNING"}
    monkeypatch.setattr(workers, "LISTING_GRACE_S", 0.0)
    time.sleep(0.01)
    with pytest.raises(RunFailed, match="could not be listed for 0 s: .*Socket timed out"):
        fleet.poll_jobs()
    jobs.jobs = lambda: listed
    fleet.poll_jobs()  # answers again: the count starts over
    assert fleet._listing_failed_since is None


def test_a_lost_worker_whose_job_is_still_active_is_cancelled(tmp_path):
    """Slurm requeued it after a node failure, or only its Dask worker left: its job would hold
    a node unseen while the replacement runs."""
    from schedulers import JobStatus

    fleet, _ = _fleet(tmp_path)
    fleet.jobs = {"local-900": JobStatus("local-900", "rollout", "rollout-0", "PENDING", None, None, None),
                  "local-901": JobStatus("local-901", "rollout", "rollout-1", "FAILED", "exit code 1", None, None)}
    fleet.lost(fleet.workers["rollout-0"], "worker left the Dask scheduler")
    fleet.lost(fleet.workers["rollout-1"], "job FAILED")
    assert fleet.parts.schedulers["local"].cancelled == ["local-900"]  # the failed one is over already


def test_a_node_worker_running_other_code_fails_its_placement_and_the_run_goes_on(tmp_path):
    from astraflow.runtime.workers import WorkerUnusable

    fleet, _ = _fleet(tmp_path)
    fleet.placement = _Placement(fleet)

    def place(name, part):
        raise WorkerUnusable(f"worker {name} runs other code than this run (1 source file(s) differ (x.py))")

    fleet.place_node = place
    w = fleet.workers["rollout-0"]
    w.enter("submitted")
    w.joined_at = time.time()
    fleet.advance()  # no RunFailed: the node's slot is refilled
    assert w.phase == "gone" and "runs other code than this run" in w.note
    assert fleet.parts.schedulers["local"].cancelled == ["local-900"]
    assert fleet.workers["rollout-1"].phase == "serving"
