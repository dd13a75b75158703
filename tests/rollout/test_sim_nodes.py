"""Many sim RaaS nodes in one process (``rollout.nodes_per_worker``): fifty real nodes, one
shared event loop, one real data layer. Every node leases, generates and writes its own
segment, and no node's heartbeat is starved by the others' work.

The data layer runs in this process behind ``LocalActor`` (the stand-in for the Dask actor
handle of ``test_episode_failures``); the nodes, sim engines, trajectory store, leases and
ledger are the real ones."""

from __future__ import annotations

import threading
import time

import pytest

from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.layer import DataLayer
from astraflow.rollout.config import EngineConfig, RolloutConfig
from astraflow.rollout.node import NodeIdentity
from astraflow.rollout.node_group import RaaSNodeGroup, member_name
from astraflow.rollout.sim_config import SimEngineConfig
from astraflow.training.sim_backend import SimBackend
from astraflow.workloads.config import SamplingConfig, WorkloadConfig
from storage.trajectories import open_trajectory_store
from storage.weights import WeightStore
from tests.rollout.test_episode_failures import LocalActor

NODES = 50
SIM = {"num_train": 5000, "num_test": 10}


def _sim_group(tmp_path, prefetch_groups: int, **rollout) -> tuple[LocalActor, RaaSNodeGroup]:
    """A real data layer (in this process, behind ``LocalActor``) and one worker's group of sim
    nodes (``rollout``: the group's ``RolloutConfig`` fields), with version 0 published."""
    url, weights = str(tmp_path / "trajectories"), str(tmp_path / "weights")
    SimBackend().publish(WeightStore(weights), "p", 0)
    layer = DataLayer(dataflow=DataflowConfig(batch_size=16, lease_seconds=300, max_staleness=1000,
                                                    prefetch_groups=prefetch_groups, durable=False),
                      workload=WorkloadConfig(name="sim", workflow="sim", params=SIM, group_size=4),
                      policies=["p"], store_url=url, metrics_path=str(tmp_path / "metrics.jsonl"), max_steps=10_000)
    dl = LocalActor(layer)
    dl._worker = True  # what ``bind`` sets on a Dask worker
    engine = EngineConfig(type="sim", sim=SimEngineConfig(hardware="h100", length_mean=60, time_scale=4.0))
    group = RaaSNodeGroup(identity=NodeIdentity(name="w0"), data_layer=dl,
                          rollout=RolloutConfig(engine=engine, capacity=4, **rollout),
                          models={"p": "sim"}, workload_name="sim", workload_params=SIM, workload_seed=0,
                          workflow="sim", sampling=SamplingConfig(max_new_tokens=128), store_url=url,
                          weights_root=weights)
    return dl, group


@pytest.mark.timeout(180)
def test_fifty_sim_nodes_share_one_loop_and_all_keep_their_heartbeats(tmp_path):
    url = str(tmp_path / "trajectories")
    dl, group = _sim_group(tmp_path, prefetch_groups=100, nodes_per_worker=NODES, write_batch=8, flush_seconds=0.5)
    names = [member_name("w0", i) for i in range(NODES)]
    gaps: dict[str, float] = {}
    seen: dict[str, float] = {}
    try:
        assert group.start() == {"p": 0}
        # no node has a loop thread of its own
        assert not [t.name for t in threading.enumerate() if t.name.startswith("raas-w0")]
        end = time.monotonic() + 12.0
        while time.monotonic() < end:  # the longest time each node went without a heartbeat
            now = time.time()
            for name, info in dl.read(lambda lay: {n: dict(i) for n, i in lay.leases.nodes.items()}).items():
                if "last_seen" in info and not info.get("stock"):  # the worker's lease stock is no node
                    if name in seen:
                        gaps[name] = max(gaps.get(name, 0.0), now - info["last_seen"])
                    seen[name] = info["last_seen"]
            time.sleep(0.2)
    finally:
        state = group.stop(timeout=20)
        dl.close()
    assert set(seen) == set(names)
    # a node beats every second; fifty on one loop still do, within a loose bound
    assert max(gaps.values()) < 5.0, sorted(gaps.items(), key=lambda kv: -kv[1])[:5]
    assert state["error"] is None and state["stopped"]
    assert len({id(n._loop) for n in group.nodes}) == 1
    store = open_trajectory_store(url, "r")
    written = {seg: store.count(seg) for seg in store.segments()}
    # work goes to whichever node asks first: trajectories in several nodes' own segments
    assert sum(written.values()) >= NODES and {s.rsplit('.', 1)[0] for s in written} <= set(names)
    assert len([s for s, c in written.items() if c]) >= 5


@pytest.mark.timeout(120)
def test_sim_nodes_with_a_lease_stock_take_their_tasks_from_it_and_leave_none_behind(tmp_path):
    """``rollout.lease_ahead``: a node group's leases are answered by the worker's stock (the
    data layer sees its refills, not a lease per node), every trajectory's task completes under
    the node that ran it, and when the group stops the stock holds no lease any more."""
    dl, group = _sim_group(tmp_path, prefetch_groups=20, nodes_per_worker=8, write_batch=4, flush_seconds=0.3,
                           lease_ahead=32, lease_wait_seconds=0.5)
    try:
        group.start()
        time.sleep(5.0)
    finally:
        state = group.stop(timeout=20)
    try:
        stock = group.coalescer.stock.stats()
        held, nodes, events = dl.read(lambda lay: ({t: n for t, (n, _) in lay.leases.held.items()},
                                                  {n: dict(i) for n, i in lay.leases.nodes.items()},
                                                  dict(lay.ledger.events)))
    finally:
        dl.close()
    assert state["error"] is None and stock["handed"] > 0 and stock["refills"] > 0
    assert "w0.stock" not in held.values()  # what no node took went back; what they took moved to them
    assert events["completed"] > 0 and events.get("returned", 0) == stock["returned"]
    completed = {n: i.get("completed", 0) for n, i in nodes.items() if not i.get("stock")}
    assert sum(completed.values()) == events["completed"] and len([n for n, c in completed.items() if c]) >= 2
    assert "requeued" not in events  # no stocked task was lost and leased again
