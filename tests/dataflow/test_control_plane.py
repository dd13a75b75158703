"""The control plane's structures at scale: lease expiry by deadline, renewals of one node's
leases only, a ledger that forgets ended tasks but not their counts, batched calls that answer
exactly what single calls do, and node calls gathered by a ``Coalescer``."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

import pytest

from astraflow.dataflow.ledger import Ledger
from astraflow.rollout.coalesce import Coalescer
from tests.dataflow.test_data_layer import make_layer
from tests.dataflow.test_leases import make, ref, task


def test_leases_expire_in_deadline_order_and_a_renewal_or_a_new_lease_is_not_expired_by_an_old_entry():
    leases, _ = make()
    for i in range(4):
        leases.add(task(f"g/{i}"))
    got = leases.take("n", 4)
    for t, deadline in zip(got, (10.0, 20.0, 30.0, 40.0)):
        leases.hold(t.task_id, "n", deadline)
    leases.held["g/1"] = ("n", 1e18)  # renewed (a renewal writes ``held`` only)
    leases.expire()  # now is far past every heap deadline: g/0, g/2, g/3 expire; g/1 was renewed
    assert set(leases.held) == {"g/1"} and list(leases.pending) == ["g/3", "g/2", "g/0"]
    again = leases.take("m", 3)  # re-leased with fresh deadlines: their old entries are stale
    leases.expire()
    assert set(leases.held) == {"g/1"} | {t.task_id for t in again}
    assert leases.ledger.events["requeued_lease_expired"] == 3
    assert leases.by_node == {"n": {"g/1"}, "m": {t.task_id for t in again}}


def test_renew_touches_only_the_nodes_own_leases_and_only_those_it_holds():
    leases, _ = make()
    for i in range(6):
        leases.add(task(f"g/{i}"))
    a, b = leases.take("a", 3), leases.take("b", 3)
    for t in a + b:
        leases.hold(t.task_id, leases.held[t.task_id][0], 5.0)
    leases.renew("a", {a[0].task_id, a[1].task_id, b[0].task_id})  # b's task named by a: not renewed
    assert leases.held[a[0].task_id][1] > 5.0 and leases.held[a[1].task_id][1] > 5.0
    assert leases.held[a[2].task_id][1] == 5.0
    assert all(leases.held[t.task_id][1] == 5.0 for t in b)
    leases.renew("b")  # no list: all of b's
    assert all(leases.held[t.task_id][1] > 5.0 for t in b)
    assert leases.complete(ref(b[0], "b")) is not None and leases.by_node["b"] == {b[1].task_id, b[2].task_id}


def test_a_ledger_forgets_ended_tasks_but_keeps_their_counts_and_refuses_their_completions():
    ledger = Ledger(remember=3)
    for i in range(10):
        ledger.add(f"t{i}")
        ledger.lease(f"t{i}", "n")
        assert ledger.complete(f"t{i}")
        ledger.end(f"t{i}", "consumed" if i % 2 else "dropped", None if i % 2 else "stale")
    assert list(ledger.ended) == ["t7", "t8", "t9"] and not ledger.live
    assert ledger.summary()["states"] == {"consumed": 5, "dropped": 5} and ledger.summary()["tasks"] == 10
    assert ledger.dropped_by_reason == {"stale": 5} and ledger.summary()["open"] == 0
    assert ledger.state_of("t9") == "consumed" and ledger.tasks["t8"].state == "dropped" and len(ledger.tasks) == 3
    assert not ledger.complete("t0") and not ledger.complete("t9")  # forgotten or remembered: refused
    assert ledger.events["duplicate_completions"] == 2
    with pytest.raises(AssertionError, match="ended twice"):
        ledger.end("t9", "consumed")


def test_lease_many_and_heartbeat_many_answer_what_single_calls_do(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    single, many = make_layer(tmp_path / "a", prefetch_groups=6), make_layer(tmp_path / "b", prefetch_groups=6)
    requests = [("w0.n0", 3, {"p": 0}), ("w0.n1", 5, None), ("w0.n2", 0, None), ("w0.n3", 4, {"p": 0})]

    async def go():
        one = {n: [t.task_id for t in await single.lease(n, c, 0.0, versions=v)] for n, c, v in requests}
        both = {n: [t.task_id for t in ts] for n, ts in (await many.lease_many(requests, 0.0)).items()}
        assert one == both and sum(map(len, one.values())) == 12
        beats = {n: {"worker": "w0", "holding": one[n][:1]} for n, *_ in requests}
        replies = {n: await single.heartbeat(n, dict(s)) for n, s in beats.items()}
        assert replies == await many.heartbeat_many({n: dict(s) for n, s in beats.items()})
        assert single.leases.nodes.keys() == many.leases.nodes.keys()
        served = (await many.state())["service_ms"]  # the calls' time inside the data layer
        assert served["lease"]["n"] == 1 and served["heartbeat"]["n"] == 1
        assert 0 < served["lease"]["p50"] <= served["lease"]["p99"]
        assert {t: n for t, (n, _) in single.leases.held.items()} == {t: n for t, (n, _) in many.leases.held.items()}

    asyncio.run(go())


def test_groups_in_rollout_per_source_are_counted_as_they_come_and_go(tmp_path):
    layer = make_layer(tmp_path, prefetch_groups=4)

    async def go():
        await layer.lease("n0", 8)
        assert layer.buffers.rolling_by_source() == {"": len(layer.buffers.rolling)} and layer.buffers.rolling
        layer.buffers.rolling.clear()  # replaced behind the room's back (a restore, the run's end): recounted
        assert sum(layer.buffers.rolling_by_source().values()) == 0

    asyncio.run(go())


class _LoopHandle:
    """A data layer's methods as an actor handle's are: each call returns a future (the layer
    runs on its own event loop in a thread), and counts the calls that reach it. While ``gate``
    is clear a call is held where it is made (a busy data layer), so calls made meanwhile gather
    however slowly the machine runs the test."""

    def __init__(self, layer):
        self.layer, self.calls = layer, []
        self.gate = threading.Event()
        self.gate.set()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def __getattr__(self, name):
        def method(*args, **kwargs) -> Future:
            assert self.gate.wait(30)
            self.calls.append(name)
            return asyncio.run_coroutine_threadsafe(getattr(self.layer, name)(*args, **kwargs), self.loop)
        return method


def test_a_coalescer_gathers_the_nodes_calls_and_answers_each_node(tmp_path):
    handle = _LoopHandle(make_layer(tmp_path, prefetch_groups=6))
    co = Coalescer(handle)
    names = [f"w0.n{i}" for i in range(6)]
    handle.gate.clear()  # the senders' first calls wait: the nodes' later calls gather behind them
    leases = [co.lease(n, 2, 0.0, versions=None) for n in names]
    handle.gate.set()
    got = {n: [t.task_id for t in p.result(30)] for n, p in zip(names, leases)}
    assert all(len(v) == 2 for v in got.values()) and len({t for v in got.values() for t in v}) == 12
    handle.gate.clear()
    beats = [co.heartbeat(n, {"worker": "w0", "holding": got[n]}) for n in names]
    handle.gate.set()
    assert all(p.result(30) == {"draining": False, "finished": False} for p in beats)
    assert handle.calls.count("lease_many") < 6 and handle.calls.count("heartbeat_many") < 6
    assert "lease" not in handle.calls and "heartbeat" not in handle.calls
    assert co.stats()["lease"]["carried"] == 6 and co.stats()["heartbeat"]["carried"] == 6
    held = handle.layer.leases.held
    assert {t: n for t, (n, _) in held.items()} == {t: n for n, ts in got.items() for t in ts}
    handle.loop.call_soon_threadsafe(handle.loop.stop)


def test_nodes_on_one_loop_await_gathered_calls_without_a_thread_each(tmp_path):
    """``transport.call`` on a coalescer's answer waits on the node's loop: many nodes' calls
    in flight park no threads beyond the lanes' senders, and a deadline still raises."""
    from astraflow.pending import Pending
    from astraflow.transport import call

    handle = _LoopHandle(make_layer(tmp_path, prefetch_groups=20))
    co = Coalescer(handle)
    names = [f"w0.n{i}" for i in range(40)]

    async def go():
        before = threading.active_count()
        handle.gate.clear()
        beats = [asyncio.ensure_future(call(co.heartbeat, n, {"worker": "w0", "holding": []})) for n in names]
        leases = [asyncio.ensure_future(call(co.lease, n, 1, 0.0, versions=None)) for n in names]
        await asyncio.sleep(0)
        assert threading.active_count() - before <= 8  # the lanes' senders, not one per node
        handle.gate.set()
        replies = await asyncio.gather(*beats)
        got = await asyncio.gather(*leases)
        with pytest.raises(TimeoutError, match="within 0.05s"):
            await Pending().wait_async(0.05)
        late = Pending()
        late.settle("done")
        return replies, got, await late.wait_async(1.0)

    replies, got, late = asyncio.run(go())
    assert all(r == {"draining": False, "finished": False} for r in replies)
    ids = [t.task_id for ts in got for t in ts]
    assert len(ids) == len(set(ids)) == sum(len(ts) for ts in got) > 0
    assert late == "done"
    assert handle.calls.count("heartbeat_many") < len(names)
    handle.loop.call_soon_threadsafe(handle.loop.stop)


def test_a_gathered_answer_reaches_every_kind_of_waiter():
    """Nodes awaiting on two loops, a thread blocked in ``result`` and a node that gave up: one
    ``settle_all`` answers each (and a cancelled wait does not break it)."""
    from astraflow.pending import Pending, settle_all

    calls = [Pending() for _ in range(6)]
    blocked: list = []
    waiter = threading.Thread(target=lambda: blocked.append(calls[5].result(10)))
    waiter.start()

    waiting = [threading.Event(), threading.Event()]

    def node_loop(mine: list, out: list, cancel_first: bool, ready: threading.Event) -> None:
        async def go():
            tasks = [asyncio.ensure_future(p.wait_async(10)) for p in mine]
            await asyncio.sleep(0.05)
            if cancel_first:
                tasks[0].cancel()
            await asyncio.sleep(0)  # the cancel is through
            ready.set()
            out.extend(await asyncio.gather(*tasks, return_exceptions=True))
        asyncio.run(go())

    got_a, got_b = [], []
    loops = [threading.Thread(target=node_loop, args=(calls[0:3], got_a, True, waiting[0])),
             threading.Thread(target=node_loop, args=(calls[3:5], got_b, False, waiting[1]))]
    for t in loops:
        t.start()
    assert all(e.wait(10) for e in waiting)
    time.sleep(0.05)  # the blocked thread is in ``result`` (settling first would answer it all the same)
    settle_all((p, i) for i, p in enumerate(calls))
    for t in loops + [waiter]:
        t.join(10)
    assert isinstance(got_a[0], asyncio.CancelledError) and got_a[1:] == [1, 2]
    assert got_b == [3, 4] and blocked == [5]
    assert all(p.done() for p in calls) and calls[0].result(0) == 0


def test_the_deadline_heap_sheds_the_entries_of_ended_leases():
    leases, _ = make()
    for i in range(3000):
        leases.add(task(f"g{i}/0"))
    for t in leases.take("n", 3000)[:2900]:
        assert leases.complete(ref(t)) is not None
    leases.expire()  # nothing due; the heap holds mostly ended leases' entries: rebuilt
    assert len(leases._heap) == len(leases.held) == 100
    assert not leases.pending


def test_the_oldest_node_version_drops_at_once_and_rises_only_at_a_recount():
    from astraflow.dataflow.admission import OldestVersions
    nodes = {"a": {"versions": {"p": 3}, "last_seen": 100.0}, "b": {"versions": {"p": 5}, "last_seen": 100.0}}
    oldest = OldestVersions(["p"], every_s=1.0)
    assert oldest.get(nodes, 30.0, now=100.0) == {"p": 3}
    nodes["a"]["versions"] = {"p": 6}  # a loaded newer weights: seen at the next recount only
    oldest.saw({"p": 6})
    assert oldest.get(nodes, 30.0, now=100.5) == {"p": 3}
    assert oldest.get(nodes, 30.0, now=101.6) == {"p": 5}
    nodes["c"] = {"versions": {"p": 1}, "last_seen": 101.7}  # a node with older weights: at once
    oldest.saw({"p": 1})
    assert oldest.get(nodes, 30.0, now=101.8) == {"p": 1}
    nodes["c"]["draining"] = True
    assert oldest.get(nodes, 30.0, now=103.0) == {"p": 5}


def test_gathered_calls_wait_for_a_lost_data_layer_to_be_re_placed(tmp_path):
    """Nodes of one worker share a coalescer over a ``Link``: when the orchestrator says the
    data layer is lost, their calls' deadlines passing meanwhile are waited out and the calls
    answered by the re-placed data layer, as a single node's calls are."""
    from astraflow import transport
    from astraflow.transport import Link, call

    class _Dead:  # the lost data layer's handle: a call to it never answers
        def __getattr__(self, name):
            return lambda *a, **k: Future()

    new = _LoopHandle(make_layer(tmp_path, prefetch_groups=6))
    link = Link(_Dead(), "the data layer", reconnect_s=30)
    co = Coalescer(link)
    transport._LinkCall.SLICE_S, slice_s = 0.05, transport._LinkCall.SLICE_S
    try:
        link.expect_new()
        threading.Timer(1.0, link.set, args=(new,)).start()

        async def go():
            return await asyncio.gather(*(call(co.heartbeat, f"w0.n{i}", {"worker": "w0", "holding": []},
                                               timeout=0.3) for i in range(3)))

        t0 = time.monotonic()
        assert asyncio.run(go()) == [{"draining": False, "finished": False}] * 3
        assert time.monotonic() - t0 >= 0.9 and "heartbeat_many" in new.calls
        # not lost: a deadline is a deadline
        with pytest.raises(TimeoutError, match="within 0.2s"):
            asyncio.run(call(Coalescer(Link(_Dead(), "the data layer")).heartbeat, "w1.n0", {}, timeout=0.2))
    finally:
        transport._LinkCall.SLICE_S = slice_s
        new.loop.call_soon_threadsafe(new.loop.stop)
