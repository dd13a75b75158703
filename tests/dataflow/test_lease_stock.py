"""A worker's lease stock (``rollout.lease_ahead``): the data layer leases tasks to the stock,
a task's lease moves to the node of that worker that names it in a heartbeat or completes it,
what no node took returns without an attempt counted, the change log keeps up with every move,
and the stock's own ``LeaseStock`` answers its nodes' leases without a data-layer call each."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from astraflow.contracts import lease_stock_name
from astraflow.rollout.coalesce import Coalescer
from astraflow.rollout.lease_stock import LeaseStock
from tests.dataflow.test_changelog import same
from tests.dataflow.test_control_plane import _LoopHandle
from tests.dataflow.test_data_layer import Node, make_layer, run
from tests.dataflow.test_durable import Paths
from tests.dataflow.helpers import make_trajectory, store_and_ref
from tests.dataflow.test_leases import make, ref, task

STOCK = lease_stock_name("w0")


def test_a_stocked_task_moves_to_the_node_of_its_worker_that_names_it_or_completes_it():
    leases, _ = make()
    leases.node(STOCK).update(stock=True, worker="w0")
    leases.node("w0.n0").update(worker="w0")
    leases.node("w1.n0").update(worker="w1")
    for i in range(5):
        leases.add(task(f"g/{i}"))
    stocked = [t.task_id for t in leases.take(STOCK, 4)]
    direct = leases.take("w1.n0", 1)[0].task_id  # a node's own lease never moves
    leases.renew("w0.n0", {stocked[0], direct})
    assert leases.held[stocked[0]][0] == "w0.n0" and leases.ledger.live[stocked[0]].node == "w0.n0"
    assert leases.held[direct][0] == "w1.n0"
    leases.renew("w1.n0", {stocked[1]})  # another worker's node: the stock's task stays
    assert leases.held[stocked[1]][0] == STOCK
    assert leases.complete(ref(leases.tasks[stocked[2]], "w0.n0")) is not None  # done before its heartbeat
    assert leases.nodes["w0.n0"]["leased"] == 2 and leases.nodes[STOCK]["leased"] == 2
    leases.unlease(stocked[3])  # the stock gives back what no node took: no attempt counted
    assert list(leases.pending)[0] == stocked[3] and leases.tasks[stocked[3]].attempt == 0
    assert leases.ledger.state_of(stocked[3]) == "pending" and leases.ledger.events["returned"] == 1
    assert leases.take("w0.n0", 1)[0].attempt == 0
    assert leases.by_node[STOCK] == {stocked[1]}


def test_the_change_log_follows_a_stock_its_moves_and_returns(tmp_path):
    paths = Paths(tmp_path)
    layer = paths.layer()

    async def go():
        got = [t.task_id for t in await layer.lease_ahead("w0", 6)]
        assert len(got) == 6 and {layer.leases.held[t][0] for t in got} == {STOCK}
        same(paths, layer)
        await layer.heartbeat_many({STOCK: {"stock": True, "worker": "w0", "holding": got[3:]},
                                    "w0.n0": {"worker": "w0", "stocked": True, "holding": got[:2], "slots": 8},
                                    "w0.n1": {"worker": "w0", "stocked": True, "holding": [], "slots": 8}})
        assert {t: layer.leases.held[t][0] for t in got[:3]} == {got[0]: "w0.n0", got[1]: "w0.n0", got[2]: STOCK}
        await layer.durability.commit()
        same(paths, layer)
        node = Node(layer, "w0.n1")
        await layer.complete(store_and_ref(node.writer, [make_trajectory(layer.leases.tasks[got[2]], 1.0,
                                                                       node="w0.n1")]))
        assert await layer.return_leases("w0", got[3:] + got[:1]) == 3  # got[0] is a node's now: kept
        assert list(layer.leases.pending)[:3] == got[3:] and layer.ledger.events["returned"] == 3
        same(paths, layer)
        state = await layer.state()
        assert STOCK not in state["nodes"] and state["lease_stocks"][STOCK]["worker"] == "w0"
        assert layer._node_slots() == 16  # the nodes' slots from their heartbeats; the stock has none
        again = [t.task_id for t in await layer.lease_ahead("w0", 2)]
        await layer.drain("w0")  # a worker's drain reaches its stock
        assert await layer.lease_ahead("w0", 2) == []
        assert await layer.node_gone("w0") == 4 and not layer.leases.held  # the stock's two and w0.n0's two
        assert {layer.leases.tasks[t].attempt for t in again} == {1}
        same(paths, layer)
        await layer.close()

    run(go())


def _wait_for(cond, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_nodes_lease_from_the_stock_without_a_call_each_and_a_drain_returns_the_rest(tmp_path):
    layer = make_layer(tmp_path, prefetch_groups=10)
    handle = _LoopHandle(layer)
    co = Coalescer(handle, worker="w0", lease_ahead=16, lease_wait_s=0.2)
    try:
        waited = co.lease("w0.n0", 4, 5.0, versions={"p": 0}).result(10)  # a long poll: the first refill answers it
        assert len(waited) == 4
        _wait_for(lambda: co.stock.stats()["stocked"] >= 3)  # then it keeps at least one node's ask
        names = [f"w0.n{i}" for i in range(1, 4)]
        got = {n: [t.task_id for t in co.lease(n, 1, 0.0, versions={"p": 1}).result(1)] for n in names}
        assert all(len(ids) == 1 for ids in got.values())
        assert "lease_many" not in handle.calls and "lease" not in handle.calls  # the stock's refills only
        assert co.stock.beat()["versions"] == {"p": 0}  # it reports its most behind node's versions
        beats = [co.heartbeat(n, {"worker": "w0", "holding": ids}) for n, ids in got.items()]
        assert all(p.result(30) == {"draining": False, "finished": False} for p in beats)
        holders = {t: n for t, (n, _) in layer.leases.held.items()}
        assert all(holders[t] == n for n, ids in got.items() for t in ids)
        assert layer.leases.nodes["w0.n1"]["stocked"] and layer.leases.nodes[STOCK]["stock"]
        stocked = co.stock.stats()["stocked"]
        co.drain()  # a refill on its way as the drain began is returned with the rest
        assert co.stock.counts["returned"] >= stocked and co.stock.stats()["stocked"] == 0
        # what w0.n0 took stays the stock's until that node's heartbeat names it
        assert {t for t, (n, _) in layer.leases.held.items() if n == STOCK} == {t.task_id for t in waited}
        assert co.lease("w0.n1", 1, 0.0).result(30) and "lease_many" in handle.calls  # stopped: the lanes
    finally:
        co.drain()
        handle.loop.call_soon_threadsafe(handle.loop.stop)


class _HoldingHandle(_LoopHandle):
    """``_LoopHandle`` that counts the tasks asked for by refills held at its closed gate."""

    def __init__(self, layer):
        super().__init__(layer)
        self.held: list[int] = []

    def lease_ahead(self, worker, want, wait):
        if not self.gate.is_set():
            self.held.append(want)
        return self.__getattr__("lease_ahead")(worker, want, wait)


def test_a_lease_on_an_empty_stock_is_answered_at_once_without_a_long_poll(tmp_path):
    layer = make_layer(tmp_path, prefetch_groups=0, batch_size=4, group_size=4)  # one group: four tasks
    handle = _HoldingHandle(layer)
    co = Coalescer(handle, worker="w0", lease_ahead=4, lease_wait_s=0.2)
    try:
        first = co.lease("w0.n0", 8, 5.0).result(10)
        assert len(first) == 4
        empty = co.lease("w0.n1", 1, 0.0)  # none left anywhere: answered as it is asked, no wait
        assert empty.done() and empty.result(0) == []
        handle.gate.clear()  # every refill on its way is held: none can answer a waiting node
        deadline = time.monotonic() + 30
        while co.stock._asking != sum(handle.held) or not handle.held:
            assert time.monotonic() < deadline, "the stock's refills did not reach the held data layer"
            time.sleep(0.01)
        refills = co.stock.counts["refills"]
        waiting = co.lease("w0.n1", 1, 30.0)
        assert not waiting.done()  # a long poll: it waits for the stock's refill
        handle.gate.set()
        assert waiting.result(10) == []  # which found nothing: it ends with the stock's, not its own 30 s
        assert co.stock.counts["refills"] > refills
    finally:
        handle.gate.set()
        co.drain()
        handle.loop.call_soon_threadsafe(handle.loop.stop)


class _SlowHandle:
    """A data layer whose long poll finds nothing for a while: refills stay on their way."""

    def __init__(self, poll_s: float):
        self.poll_s, self.returned = poll_s, []

    def lease_ahead(self, worker, want, wait):
        fut = Future()
        threading.Timer(self.poll_s, fut.set_result, ([],)).start()
        return fut

    def return_leases(self, worker, task_ids):
        self.returned += task_ids
        fut = Future()
        fut.set_result(len(task_ids))
        return fut


def test_while_admission_refuses_a_waiting_node_whose_weights_are_behind_is_answered_at_once():
    stock = LeaseStock(_SlowHandle(1.0), "w0", most=8, wait_s=0.5)
    behind = stock.lease("w0.n0", 2, 5.0, {"p": 1})
    current = stock.lease("w0.n1", 2, 5.0, {"p": 3})
    assert not behind.done() and not current.done()  # both wait for the stock's refill
    assert stock.beat()["versions"] == {"p": 1}  # the stock stands for its most behind asking node
    stock.answered({"draining": False, "finished": False, "versions": {"p": 3}, "refused": 0})
    assert not behind.done()  # admission admits: waiting is right
    stock.answered({"draining": False, "finished": False, "versions": {"p": 3}, "refused": 2})
    assert behind.result(1) == [] and not current.done()  # it asks again with the weights it loads next
    stock.drain()
    assert current.result(1) == []


def test_a_stock_without_a_long_poll_backs_off_when_the_data_layer_has_nothing():
    """``lease_wait_seconds: 0``: every refill comes back empty at once while the data layer has
    no task; the stock pauses between them (doubling) instead of asking in a tight loop."""
    handle = _SlowHandle(0.0)
    calls = []
    lease_ahead = handle.lease_ahead
    handle.lease_ahead = lambda worker, want, wait: calls.append(wait) or lease_ahead(worker, want, wait)
    stock = LeaseStock(handle, "w0", most=8, wait_s=0.0)
    try:
        assert stock.lease("w0.n0", 4, 0.0, None).result(5) == []
        time.sleep(1.0)
    finally:
        stock.drain()
    assert 1 <= len(calls) < 40, len(calls)
