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
    with pytest.raises(RunFailed, match=r"workers did not join within 0s: \['rollout-h100-0'\]; see .*; the Dask "
                                        r"scheduler listens on 127\.0\.0\.1"):
        placement.wait_workers(["rollout-h100-0"], lambda: {"rollout-h100-0": "RUNNING"}, hint=hint)
