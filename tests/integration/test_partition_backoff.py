"""A crash-looping partition, without a cluster: each failure of a worker delays the next
refill (a growing backoff) and enough of them stop the refills; both are visible in the status
text. A worker lost soon after it began serving counts, one lost after long service does not.
Worker jobs go to a fake ``sbatch`` on PATH (the process boundary to Slurm), which also lets a
partial submission fail part way: the partition is then marked failed, naming the cancelled jobs."""

from __future__ import annotations

import time
from concurrent.futures import Future

from astraflow.config import ClusterConfig
from astraflow.runtime.control import write_desired
from astraflow.runtime.monitoring import StatusWriter, format_partitions
from astraflow.runtime.progress import Progress
from astraflow.runtime.reconcile import FAILURES_PER_NODE, REFILL_BACKOFF_S, PartitionSet
from astraflow.runtime.workers import SERVED_LONG_S, Fleet
from schedulers import Partition
from storage.paths import RunPaths

from tests.schedulers.fake_slurm import fake_slurm


class _DataLayer:
    """What `Fleet.lost` calls on the data layer's actor handle: ``node_gone`` (no leases held)."""

    def node_gone(self, name: str) -> Future:
        fut: Future = Future()
        fut.set_result(0)
        return fut


def _setup(tmp_path, nodes: int = 1, autoscale: dict | None = None, walltime: str = "01:00:00"):
    paths = RunPaths(tmp_path / "run").make()
    progress = Progress(enabled=False)
    part = Partition(name="gpu", scheduler="slurm", nodes=nodes, role="rollout", autoscale=autoscale,
                     walltime=walltime)
    pset = PartitionSet([part], paths, ClusterConfig(), progress)
    fleet = Fleet(pset, placement=None, cluster=ClusterConfig(), progress=progress, place_node=lambda n, p: None)
    fleet.dl = _DataLayer()
    write_desired(paths, [part])
    return paths, pset, fleet


def _reconcile(pset: PartitionSet, fleet: Fleet) -> None:
    pset.reconcile(fleet, address_for=lambda part: "tcp://127.0.0.1:8786")


def _status_text(paths: RunPaths, pset: PartitionSet, fleet: Fleet) -> str:
    writer = StatusWriter(paths, "t", pset, fleet)
    return format_partitions({"partitions": writer.partitions()})


def _calls(rec) -> int:
    return int((rec / "calls").read_text()) if (rec / "calls").exists() else 0


def test_a_failing_partition_is_refilled_after_a_backoff_then_no_more(tmp_path, monkeypatch):
    rec = fake_slurm(tmp_path, monkeypatch, fail_at=99)
    paths, pset, fleet = _setup(tmp_path)
    _reconcile(pset, fleet)
    assert _calls(rec) == 1
    [w] = fleet.workers.values()
    w.enter("serving")
    fleet.lost(w, "job 4101 FAILED")  # soon after it began serving: a crash
    ps = pset.state["gpu"]
    assert ps.failures == 1 and ps.refill_at is not None and ps.state == "active"
    _reconcile(pset, fleet)
    assert _calls(rec) == 1, "refilled during its backoff"
    text = _status_text(paths, pset, fleet)
    assert "failures: 1 worker(s) failed; refilling in 2s (backoff)" in text, text
    time.sleep(REFILL_BACKOFF_S + 0.1)
    _reconcile(pset, fleet)
    assert _calls(rec) == 2
    delays = []
    for i in range(FAILURES_PER_NODE - 1):
        [live] = [x for x in fleet.workers.values() if not x.gone]
        fleet.lost(live, "job FAILED")  # before serving
        if ps.refill_at is not None:
            delays.append(round(ps.refill_at - time.time()))
            ps.refill_at = time.time()  # its backoff has passed
            _reconcile(pset, fleet)
    assert delays == [2 * REFILL_BACKOFF_S] * (FAILURES_PER_NODE - 2)  # doubled after the second failure
    assert ps.state == "failed" and ps.failures == FAILURES_PER_NODE
    calls = _calls(rec)
    _reconcile(pset, fleet)
    assert _calls(rec) == calls, "a failed partition was refilled"
    text = _status_text(paths, pset, fleet)
    assert "failed" in text and f"{FAILURES_PER_NODE} workers failed (last: job FAILED); not refilling" in text


def test_a_worker_lost_after_long_service_is_not_a_failure(tmp_path, monkeypatch):
    fake_slurm(tmp_path, monkeypatch, fail_at=99)
    _, pset, fleet = _setup(tmp_path)
    _reconcile(pset, fleet)
    [w] = fleet.workers.values()
    w.enter("serving")
    w.since -= SERVED_LONG_S + 1
    fleet.lost(w, "job 4101 PREEMPTED")
    assert pset.state["gpu"].failures == 0 and pset.state["gpu"].refill_at is None


def test_workers_that_serve_until_a_short_walltime_do_not_fail_their_partition(tmp_path, monkeypatch):
    """A partition whose walltime is shorter than ``SERVED_LONG_S``: each worker serves, then
    Slurm ends it at its walltime (seen as the job's TIMEOUT or as the worker leaving the
    scheduler first). That is the healthy end of a worker, refilled every time, never a crash
    loop that fails the partition (and with it the run); a worker lost soon after it began
    serving still counts."""
    fake_slurm(tmp_path, monkeypatch, fail_at=99)
    _, pset, fleet = _setup(tmp_path, walltime="00:02:00")
    ps = pset.state["gpu"]
    for why in ["job 4101 FAILED (TimeLimit)"] + ["worker left the Dask scheduler"] * FAILURES_PER_NODE:
        _reconcile(pset, fleet)
        [w] = [x for x in fleet.workers.values() if not x.gone]
        w.enter("serving")
        w.since -= 61  # served more than half its 2-minute walltime
        fleet.lost(w, why)
        assert ps.failures == 0 and ps.state == "active" and ps.refill_at is None, why
    _reconcile(pset, fleet)
    [w] = [x for x in fleet.workers.values() if not x.gone]
    w.enter("serving")
    w.since -= 20
    fleet.lost(w, "job 4105 FAILED")
    assert ps.failures == 1


def test_a_partial_submission_marks_the_partition_failed_naming_the_cancelled_jobs(tmp_path, monkeypatch):
    rec = fake_slurm(tmp_path, monkeypatch, fail_at=3)
    paths, pset, fleet = _setup(tmp_path, nodes=4)
    _reconcile(pset, fleet)
    assert (rec / "scancel.log").read_text().split() == ["4101", "4102"]
    assert not fleet.workers  # nothing of the request is tracked
    ps = pset.state["gpu"]
    assert ps.state == "failed"
    assert "cancelled the 2 job(s) it had already submitted (4101, 4102)" in ps.error
    assert "Requested node configuration is not available" in _status_text(paths, pset, fleet)


def test_a_failed_cancel_does_not_end_the_run_and_is_tried_again(tmp_path, monkeypatch):
    """A Slurm controller that does not answer one ``scancel`` (shrinking a partition) must not
    end the run: the job is cancelled on a later tick, or at the run's end."""
    fake_slurm(tmp_path, monkeypatch, fail_at=99, scancel_rc=1)
    paths, pset, fleet = _setup(tmp_path, nodes=2)
    _reconcile(pset, fleet)
    assert len(fleet.workers) == 2
    write_desired(paths, [pset.partitions["gpu"].model_copy(update={"nodes": 1})])
    _reconcile(pset, fleet)  # the removed worker's cancel fails: noted, kept for later
    [left] = pset.uncancelled("slurm")
    assert sum(1 for w in fleet.workers.values() if not w.gone) == 1
    (tmp_path / "again").mkdir()
    fake_slurm(tmp_path / "again", monkeypatch, fail_at=99)  # the controller answers again
    _reconcile(pset, fleet)
    assert pset.uncancelled("slurm") == [] and left in (tmp_path / "again" / "scancel.log").read_text().split()


def test_a_failed_grow_of_a_serving_partition_backs_off_instead_of_failing_it(tmp_path, monkeypatch):
    """One refused sbatch while growing a partition that serves (a queue limit) is a failure to
    back off from, not the end of the partition: its workers are still refilled."""
    rec = fake_slurm(tmp_path, monkeypatch, fail_at=2)  # the second sbatch is refused
    paths, pset, fleet = _setup(tmp_path, nodes=1)
    _reconcile(pset, fleet)
    [w] = fleet.workers.values()
    w.enter("serving")
    w.since -= SERVED_LONG_S + 1
    write_desired(paths, [pset.partitions["gpu"].model_copy(update={"nodes": 2})])
    _reconcile(pset, fleet)
    assert _calls(rec) == 2 and pset.state["gpu"].state == "active"
    fleet.lost(w, "job 4101 FAILED (TimeLimit)")
    pset.state["gpu"].refill_at = time.time() - 1  # the backoff has passed
    _reconcile(pset, fleet)
    assert pset.state["gpu"].state == "active"
    assert sum(1 for x in fleet.workers.values() if not x.gone) == 2


def _serving_autoscaled(tmp_path):
    """An autoscaled partition (1..3 workers) whose one worker has served long."""
    paths, pset, fleet = _setup(tmp_path, autoscale={"min_nodes": 1, "max_nodes": 3})
    _reconcile(pset, fleet)
    [first] = fleet.workers.values()
    first.enter("serving")
    first.since -= SERVED_LONG_S + 1
    return paths, pset, fleet, first


def test_an_autoscaled_partition_whose_added_workers_keep_failing_goes_back_to_those_that_serve(tmp_path, monkeypatch):
    """The autoscaler grew a serving partition and every added worker fails: the partition is not
    failed (its first worker still serves, and a failed partition can never be scaled again); it
    goes back to the workers that serve, in the desired file too, and may be grown again."""
    from astraflow.runtime.control import read_desired_file

    fake_slurm(tmp_path, monkeypatch, fail_at=99)
    paths, pset, fleet, first = _serving_autoscaled(tmp_path)
    write_desired(paths, [pset.partitions["gpu"].model_copy(update={"nodes": 2})])  # the autoscaler's add
    ps = pset.state["gpu"]
    for _ in range(FAILURES_PER_NODE * 2):
        ps.refill_at = None  # its backoff has passed
        _reconcile(pset, fleet)
        [added] = [w for w in fleet.workers.values() if not w.gone and w is not first]
        fleet.lost(added, "job FAILED")  # before it served
        if pset.partitions["gpu"].nodes == 1:
            break
    assert ps.state == "active" and ps.failures == 0 and ps.error is None
    assert pset.partitions["gpu"].nodes == 1 and read_desired_file(paths)[0]["gpu"].nodes == 1
    _reconcile(pset, fleet)
    assert [w for w in fleet.workers.values() if not w.gone] == [first]  # nothing more submitted


def test_an_autoscaled_grow_that_sbatch_keeps_refusing_goes_back_to_the_workers_that_serve(tmp_path, monkeypatch):
    """A queue limit refuses every added worker's job: the partition is not failed (its worker
    still serves), it goes back to that worker and is marked so the autoscaler leaves it be."""
    rec = fake_slurm(tmp_path, monkeypatch, fail_at=99)
    paths, pset, fleet, first = _serving_autoscaled(tmp_path)
    refuse = rec / "bin" / "sbatch"
    refuse.write_text("#!/bin/sh\necho 'sbatch: error: QOSMaxSubmitJobPerUserLimit' >&2\nexit 1\n")
    write_desired(paths, [pset.partitions["gpu"].model_copy(update={"nodes": 2})])  # the autoscaler's add
    ps = pset.state["gpu"]
    for _ in range(FAILURES_PER_NODE * 2 + 2):
        ps.refill_at = None  # its backoff has passed
        _reconcile(pset, fleet)
    assert ps.state == "active" and ps.error is None and ps.shrunk_at is not None
    assert pset.partitions["gpu"].nodes == 1
