"""Waiting for an actor to be built on its worker: one whose worker is lost meanwhile (killed,
out of memory) fails the wait at once naming the worker, instead of at the placement deadline
(Dask keeps a task pinned to a worker that left waiting for it)."""

from __future__ import annotations

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
