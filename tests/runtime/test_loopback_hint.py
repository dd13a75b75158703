"""Slurm workers and a scheduler on loopback (the default): a one-host Slurm works, workers on
other hosts cannot join; the run says so up front and with the failure to join."""

from __future__ import annotations

import pytest

from astraflow.config import ClusterConfig
from astraflow.runtime.placement import Placement, loopback_hint
from astraflow.runtime.progress import Progress
from astraflow.runtime.workers import RunFailed
from schedulers import Partition
from storage.paths import RunPaths

SLURM = Partition(name="h100", scheduler="slurm", role="rollout")
LOCAL = Partition(name="cpu", scheduler="local", role="rollout")


@pytest.mark.parametrize("cluster, parts, said", [
    ({}, [SLURM, LOCAL], True),
    ({"scheduler_host": "localhost"}, [SLURM], True),
    ({}, [LOCAL], False),
    ({"scheduler_interface": "ib0"}, [SLURM], False),
    ({"scheduler_host": "10.1.2.3"}, [SLURM], False),
])
def test_the_hint_is_given_only_for_slurm_workers_and_a_loopback_scheduler(cluster, parts, said):
    hint = loopback_hint(ClusterConfig(**cluster), parts)
    assert bool(hint) == said
    if said:
        assert "Slurm partition(s) h100 " in hint and "cluster.scheduler_interface" in hint


def test_workers_that_do_not_join_fail_the_run_with_the_hint(tmp_path):
    placement = Placement(RunPaths(tmp_path / "run").make(), ClusterConfig(worker_start_timeout_s=0.3),
                          Progress(enabled=False))
    placement.joined = lambda: {}  # nobody joins: a scheduler the workers cannot reach
    hint = loopback_hint(ClusterConfig(), [SLURM])
    with pytest.raises(RunFailed, match=r"workers did not join within 0s \(cluster.worker_start_timeout_s\): "
                                        r"rollout-h100-0 \(RUNNING\); see .*; "
                                        r"the Dask scheduler listens on 127\.0\.0\.1"):
        placement.wait_workers(["rollout-h100-0"], lambda: {"rollout-h100-0": "RUNNING"}, hint=hint)


def test_a_rollout_worker_queued_by_slurm_does_not_hold_the_start_back(tmp_path):
    """A rollout partition with no free node: its job waits in the queue. Once the data layer,
    the trainer and another rollout worker joined, the run starts without it (it joins when
    Slurm starts it, as a refill's worker does) instead of failing at the join deadline."""
    notes: list[str] = []
    progress = Progress(enabled=False)
    progress.note = notes.append
    placement = Placement(RunPaths(tmp_path / "run").make(), ClusterConfig(worker_start_timeout_s=30), progress)
    placement.joined = lambda: {"data-data-local-cpu-0": "a", "rollout-h100-local-H100-0": "b"}
    placement.ask_code = lambda workers: notes.append(f"asked {sorted(workers)}")
    placement.wait_workers(["data-data-local-cpu-0", "rollout-h100-local-H100-0", "rollout-a100-local-A100-0"],
                           lambda: {"rollout-a100-local-A100-0": "PENDING"})
    assert notes[0] == ("starting without 1 rollout worker(s) whose jobs wait in the queue "
                        "(rollout-a100-local-A100-0): they join when Slurm starts them"), notes
    assert notes[1] == "asked ['data-data-local-cpu-0', 'rollout-h100-local-H100-0']"


def test_queued_workers_that_hold_the_start_are_named_with_their_state_not_the_network_hint(tmp_path):
    """No rollout worker joined (or a data or trainer job waits): the run cannot start, and the
    failure says the jobs wait in the queue, not that the network keeps them out."""
    placement = Placement(RunPaths(tmp_path / "run").make(), ClusterConfig(worker_start_timeout_s=0.3),
                          Progress(enabled=False))
    placement.joined = lambda: {"data-data-local-cpu-0": "a"}
    with pytest.raises(RunFailed) as err:
        placement.wait_workers(["data-data-local-cpu-0", "rollout-h100-local-H100-0"],
                               lambda: {"rollout-h100-local-H100-0": "PENDING"},
                               hint=loopback_hint(ClusterConfig(), [SLURM]))
    assert "rollout-h100-local-H100-0 (PENDING)" in str(err.value) and "127.0.0.1" not in str(err.value)
