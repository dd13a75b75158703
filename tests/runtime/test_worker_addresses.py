"""Where a run's workers listen: local partitions' workers (the data layer and the trainers in
the usual layout) must be reachable from Slurm workers on other hosts whenever the scheduler is."""

from __future__ import annotations

from astraflow.runtime.reconcile import run_scheduler
from astraflow.sections import ClusterConfig
from schedulers import Partition
from schedulers.command import partition_worker_command
from storage.paths import RunPaths


def _command(tmp_path, **cluster) -> list[str]:
    sched = run_scheduler("local", RunPaths(tmp_path / "run"), ClusterConfig(**cluster), None)
    return partition_worker_command(Partition(name="data", role="data"), "tcp://x:1", "w", python="py",
                                    host=sched.host, interface=sched.interface)


def test_a_one_host_run_keeps_its_local_workers_on_loopback(tmp_path):
    cmd = _command(tmp_path)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and "--interface" not in cmd


def test_local_workers_listen_where_the_scheduler_does_on_a_cluster(tmp_path):
    cmd = _command(tmp_path, scheduler_host="10.1.2.3")
    assert cmd[cmd.index("--host") + 1] == "10.1.2.3"
    for cluster in ({"scheduler_interface": "ib0"}, {"worker_interface": "ib0", "scheduler_host": "10.1.2.3"}):
        cmd = _command(tmp_path, **cluster)
        assert cmd[cmd.index("--interface") + 1] == "ib0" and "--host" not in cmd
