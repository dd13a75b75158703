"""Where each Slurm worker runs and why a queued one waits, as `astraflow status`, `partitions
list`, ``status --json`` and the dashboard's view show them: a worker job that Slurm holds in
the queue (no free node, a node down) would otherwise show only PENDING, forever, sending the
operator to ``squeue`` for the reason. Jobs go to a fake ``sbatch`` on PATH; their listing is
what ``squeue`` reported."""

from __future__ import annotations

import json
import os
import socket
import time

from astraflow.config import ClusterConfig
from astraflow.runtime.control import write_desired
from astraflow.runtime.monitoring import StatusWriter, build_status_view, format_partitions
from astraflow.runtime.monitoring.text import format_status
from astraflow.runtime.monitoring.writer import Tick
from astraflow.runtime.progress import Progress
from astraflow.runtime.reconcile import PartitionSet
from astraflow.runtime.workers import Fleet
from schedulers import JobStatus, Partition
from storage.paths import RunPaths

from tests.schedulers.fake_slurm import fake_slurm


def test_status_names_each_workers_node_and_why_a_queued_one_waits(tmp_path, monkeypatch):
    fake_slurm(tmp_path, monkeypatch, fail_at=99)
    paths = RunPaths(tmp_path / "run").make()
    part = Partition(name="a100", scheduler="slurm", slurm_partition="a100", nodes=2, role="rollout")
    pset = PartitionSet([part], paths, ClusterConfig(), Progress(enabled=False))
    fleet = Fleet(pset, placement=None, cluster=ClusterConfig(), progress=Progress(enabled=False),
                  place_node=lambda n, p: None)
    write_desired(paths, [part])
    pset.reconcile(fleet, address_for=lambda p: "tcp://127.0.0.1:8786")
    running, queued = fleet.workers.values()
    fleet.jobs = {
        running.job.job_id: JobStatus(running.job.job_id, "a100", running.name, "RUNNING", None, "RUNNING", "a100-1"),
        queued.job.job_id: JobStatus(queued.job.job_id, "a100", queued.name, "PENDING", "Resources", "PENDING"),
    }
    # this process stands in for the live orchestrator (the view of a run that ended shows no placement)
    paths.orchestrator_file.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                   "started": time.time() - 10}))
    running.enter("serving")
    StatusWriter(paths, "t", pset, fleet).write(Tick(data_layer={}, trainers={}))
    st = json.loads((paths.control / "status.json").read_text())

    text = format_status(st)
    assert f"{running.name}" in text and "on a100-1" in text, text
    assert "waiting: Resources" in text, text
    assert f"waiting in the queue: job {queued.job.job_id} (Resources)" in format_partitions(st)
    [view] = build_status_view(paths.root).partitions
    nodes = {n.name: n for n in view.nodes}
    assert (nodes[running.name].host, nodes[running.name].reason) == ("a100-1", None)
    assert (nodes[queued.name].host, nodes[queued.name].reason) == (None, "Resources")
    # what the text's `serving` column and worker phases say, `--json` says too: a script waiting for
    # a partition to serve cannot tell a queued or loading worker from a serving one by `live`
    assert (view.live, view.serving) == (2, 1), view
    assert (nodes[running.name].phase, nodes[queued.name].phase) == ("serving", "submitted")
