"""Waiting for an actor to be built on its worker: one whose worker is lost meanwhile (killed,
out of memory) fails the wait at once naming the worker, instead of at the placement deadline
(Dask keeps a task pinned to a worker that left waiting for it)."""

from __future__ import annotations

import time

import pytest

from astraflow.config import ClusterConfig
from astraflow.runtime.placement import Placement
from astraflow.runtime.progress import Progress
from astraflow.runtime.workers import RunFailed, WorkerUnusable
from storage.paths import RunPaths


class _Pending:
    """A Dask future of an actor not built yet: ``result`` times out ``waits`` times, then answers."""

    def __init__(self, key: str, waits: int):
        self.key, self.waits = key, waits

    def result(self, timeout=None):
        if self.waits > 0:
            self.waits -= 1
            raise TimeoutError
        return "actor"


class _Client:
    def __init__(self, waits: int):
        self.waits = waits

    def submit(self, *args, key, **kwargs):
        return _Pending(key, self.waits)


def _placement(tmp_path, monkeypatch, workers: dict, waits: int) -> Placement:
    placement = Placement(RunPaths(tmp_path / "run").make(), ClusterConfig(placement_timeout_s=3600),
                          Progress(enabled=False))
    placement.client = _Client(waits)
    monkeypatch.setattr(placement, "joined", lambda: dict(workers))
    monkeypatch.setattr(placement, "check_code", lambda worker, address: None)
    return placement


def test_an_actor_whose_worker_was_lost_fails_the_wait_at_once_naming_the_worker(tmp_path, monkeypatch):
    workers = {"trainer-trainer-0": "tls://127.0.0.1:1"}
    placement = _placement(tmp_path, monkeypatch, workers, waits=10**9)
    fut = placement.submit_actor(dict, "trainer-trainer-0")
    workers.clear()  # SIGKILLed while its trainer was built
    with pytest.raises(RunFailed, match="placing trainers: worker trainer-trainer-0 was lost before solver was "
                                        "ready .*`astraflow run` on the run directory resumes"):
        placement.wait_all("placing trainers", {"solver": fut})


def test_an_actor_whose_worker_stays_is_waited_for(tmp_path, monkeypatch):
    workers = {"trainer-trainer-0": "tls://127.0.0.1:1"}
    placement = _placement(tmp_path, monkeypatch, workers, waits=3)
    fut = placement.submit_actor(dict, "trainer-trainer-0")
    assert placement.wait_all("placing trainers", {"solver": fut}) == {"solver": "actor"}


def test_a_worker_that_left_before_its_actor_is_placed_is_unusable_not_a_key_error(tmp_path, monkeypatch):
    """A RaaS worker killed between the fleet seeing it joined and its node's placement: the
    placement fails as for a worker nothing can be placed on (its slot is refilled), instead of
    a KeyError that ended the whole run."""
    placement = _placement(tmp_path, monkeypatch, {}, waits=0)
    with pytest.raises(WorkerUnusable, match="worker rollout-rollout-local-cpu-2 left the Dask scheduler"):
        placement.submit_actor(dict, "rollout-rollout-local-cpu-2")


class _Building:
    """A Dask future of an actor built ``seconds`` after it is made (a data layer reading its data)."""

    def __init__(self, seconds: float):
        self.ready_at = time.monotonic() + seconds

    def result(self, timeout=None):
        left = self.ready_at - time.monotonic()
        if left > 0:
            time.sleep(min(left, timeout))
            if timeout < left:
                raise TimeoutError
        return "actor"


def test_the_data_layers_deadline_counts_the_time_the_data_took_to_read(tmp_path):
    """The data layer reads the whole dataset as it is constructed: a dataset that took ``launch``
    longer than ``cluster.placement_timeout_s`` to read failed the run at the data layer's placement."""
    def placement(data_read_s: float) -> Placement:
        return Placement(RunPaths(tmp_path / "run").make(), ClusterConfig(placement_timeout_s=0.2),
                         Progress(enabled=False), data_read_s=data_read_s)

    assert placement(0.5).wait_all("placing the data layer", {"data": _Building(0.6)}, reads_data=True) == {
        "data": "actor"}
    with pytest.raises(RunFailed, match=r"placing the data layer did not finish within 0s \(cluster.placement_timeout_s"
                                        r" and twice the 0s the data took to read\) for \['data'\]"):
        placement(0.01).wait_all("placing the data layer", {"data": _Building(1.0)}, reads_data=True)
    with pytest.raises(RunFailed, match=r"placing trainers did not finish within 0s \(cluster.placement_timeout_s\)"):
        placement(0.5).wait_all("placing trainers", {"solver": _Building(0.6)})
