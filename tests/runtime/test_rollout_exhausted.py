"""A run whose rollout partitions all stopped being refilled (their workers kept failing) and
that has no rollout node left ends at once, naming the partitions' last failure, instead of
idling until the trainers' batch timeout blames them."""

from __future__ import annotations

import time

from astraflow.config import ClusterConfig
from astraflow.runtime.progress import Progress
from astraflow.runtime.reconcile import FAILURES_PER_NODE, PartitionSet
from astraflow.runtime.workers import Fleet
from schedulers import JobRef, Partition
from storage.paths import RunPaths

LAST = "RaaS node failed: TypeError: cannot unpack non-iterable bool object"


def _fleet(tmp_path, *parts: Partition) -> Fleet:
    progress = Progress(enabled=False)
    fleet = Fleet(PartitionSet(list(parts), RunPaths(tmp_path / "run"), ClusterConfig(), progress), placement=None,
                  cluster=ClusterConfig(), progress=progress, place_node=lambda n, p: None)
    for i in range(2):
        w = fleet.add(JobRef(job_id=f"local-{900 + i}", partition=parts[0].name, worker_name=f"rollout-{i}",
                             kind="local", log=None), "rollout")
        w.enter("serving")
        w.since = time.time()
    return fleet


def _fail_until_not_refilled(fleet: Fleet, name: str) -> None:
    for _ in range(FAILURES_PER_NODE * fleet.parts.partitions[name].nodes):
        fleet.parts.record_failure(name, LAST)
    assert fleet.parts.state[name].state == "failed"


def test_no_rollout_node_left_and_no_partition_refilled_ends_the_run_naming_the_last_failure(tmp_path):
    fleet = _fleet(tmp_path, Partition(name="rollout", role="rollout", nodes=2))
    assert fleet.parts.rollout_exhausted(fleet) is None
    _fail_until_not_refilled(fleet, "rollout")
    assert fleet.parts.rollout_exhausted(fleet) is None  # a node still serves
    fleet.workers["rollout-0"].enter("gone")
    assert fleet.parts.rollout_exhausted(fleet) is None
    fleet.workers["rollout-1"].enter("gone")
    why = fleet.parts.rollout_exhausted(fleet)
    assert why is not None and why.startswith("no rollout node is left and no rollout partition is refilled")
    assert f"partition rollout: 6 workers failed (last: {LAST}); not refilling" in why


def test_another_rollout_partition_still_refilled_keeps_the_run(tmp_path):
    fleet = _fleet(tmp_path, Partition(name="rollout", role="rollout", nodes=2),
                   Partition(name="spare", role="rollout", nodes=1))
    _fail_until_not_refilled(fleet, "rollout")
    for w in fleet.of_role("rollout"):
        w.enter("gone")
    assert fleet.parts.rollout_exhausted(fleet) is None  # "spare" is refilled by the reconciler
