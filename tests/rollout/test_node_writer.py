"""The RaaS node's writer policy: write when a batch is full, when nothing else is being
generated (do not make the trainer wait ``flush_seconds`` for the last trajectories), or when
the oldest has waited ``flush_seconds``; take every finished trajectory in one wake-up; never
complete a task before its trajectory is in the store.

The node's loop is driven directly (no Dask): the data-layer handle is the process boundary, so
a recorder stands in for it; the trajectory store is a real Zarr store on disk."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest

from astraflow.rollout import node_episodes
from astraflow.rollout.config import RolloutConfig

from astraflow.workloads.config import SamplingConfig
from astraflow.contracts import RolloutTask
from astraflow.rollout.node import NodeIdentity, RaaSNode
from astraflow.rollout.process_engine import EngineProcessError
from storage.trajectories import open_trajectory_store
from tests.dataflow.helpers import make_trajectory


class _Completions:
    """Stands in for the data-layer actor handle: ``complete`` returns a done future."""

    def __init__(self, store_url: str):
        self.store_url = store_url
        self.batches: list[tuple[float, list[str]]] = []
        self.failed: list[tuple[str, str]] = []

    def fail(self, task_id, reason, attempt=None):
        self.failed.append((task_id, reason))
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(True)
        return fut

    def complete(self, refs):
        # the invariant: every completed trajectory is already readable in the store
        store = open_trajectory_store(self.store_url, "r")
        assert len(store.read([s.ref for r in refs for s in r.sequences])) == len(refs)
        self.batches.append((time.monotonic(), [r.task_id for r in refs]))
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(len(refs))
        return fut


#: seconds a wait loop below waits for what it expects before it calls the writer hung
HUNG_S = 45.0


class _WriterWaits:
    """``asyncio`` as the node's writer sees it, recording its waits for more trajectories to fill
    a batch: how many began (``began``) and how each ended (``ends``): ``"woken"`` (one finished,
    or the node closes) or ``"flush_seconds"`` (the oldest waited that long). A test then asserts
    the reason a batch went out, whatever time the machine took."""

    def __init__(self):
        self.began = 0
        self.ends: list[str] = []

    def __getattr__(self, name):
        return getattr(asyncio, name)

    async def wait_for(self, awaitable, timeout):
        self.began += 1
        try:
            result = await asyncio.wait_for(awaitable, timeout)
        except asyncio.TimeoutError:
            self.ends.append("flush_seconds")
            raise
        self.ends.append("woken")
        return result


@pytest.fixture
def writer_waits(monkeypatch) -> _WriterWaits:
    waits = _WriterWaits()
    monkeypatch.setattr(node_episodes, "asyncio", waits)
    return waits


def _node(tmp_path, **rollout) -> tuple[RaaSNode, _Completions]:
    url = str(tmp_path / "trajectories")
    dl = _Completions(url)
    node = RaaSNode(identity=NodeIdentity(name="n0"), rollout=RolloutConfig(**rollout), models={},
                    workload_name="math", workload_params={}, workload_seed=0, workflow="single_turn",
                    sampling=SamplingConfig(),
                    store_url=url, weights_root=str(tmp_path / "weights"), data_layer=dl)
    node.writer = open_trajectory_store(url, "a").writer("n0", batch_size=64)
    return node, dl


def _traj(i: int):
    return make_trajectory(RolloutTask(task_id=f"g{i}/0", group_id=f"g{i}", policies=("p",), workflow="single_turn",
                                       prompt={"q": i}, kind="train"), reward=1.0)


async def _drive(node: RaaSNode, script) -> None:
    node._finished, node._finished_event, node._closing = [], asyncio.Event(), False
    writer = asyncio.create_task(node._writer())
    await script()
    node._closing = True
    node._finished_event.set()
    await asyncio.wait_for(writer, 30)


def _finish(node: RaaSNode, trajs) -> None:
    for t in trajs:
        node.writing.add(t.task_id)
        node._finished.append((t, t.to_stored()))
    node._finished_event.set()


@pytest.mark.timeout(60)
def test_writes_at_once_when_nothing_is_generating(tmp_path, writer_waits):
    node, dl = _node(tmp_path, write_batch=1000, flush_seconds=30.0)

    async def script():
        t0 = time.monotonic()
        _finish(node, [_traj(i) for i in range(3)])  # the last episodes of the node: inflight is empty
        while not dl.batches:
            assert time.monotonic() - t0 < HUNG_S, "the writer never wrote the node's last episodes"
            await asyncio.sleep(0.01)

    asyncio.run(_drive(node, script))
    assert [ids for _, ids in dl.batches] == [["g0/0", "g1/0", "g2/0"]]
    assert writer_waits.ends == [], "the writer waited for more trajectories with nothing generating"
    assert not node.writing and node.counters["episodes"] == 3


@pytest.mark.timeout(60)
def test_holds_a_partial_batch_while_episodes_generate_then_writes_it_full(tmp_path, writer_waits):
    node, dl = _node(tmp_path, write_batch=4, flush_seconds=30.0)
    node.inflight = {"still/0": None}  # an episode is still generating

    async def script():
        _finish(node, [_traj(i) for i in range(3)])
        t0 = time.monotonic()
        while not writer_waits.began and not dl.batches:
            assert time.monotonic() - t0 < HUNG_S, "the writer never took the finished trajectories"
            await asyncio.sleep(0.01)
        assert dl.batches == [] and writer_waits.began == 1  # 3 of 4, more are coming: it waits for them
        _finish(node, [_traj(3)])
        while not dl.batches:
            assert time.monotonic() - t0 < HUNG_S, "the writer never wrote the full batch"
            await asyncio.sleep(0.01)

    asyncio.run(_drive(node, script))
    assert [len(ids) for _, ids in dl.batches] == [4]
    assert writer_waits.ends == ["woken"], "the full batch went out by age, not because it was full"


@pytest.mark.timeout(60)
def test_flushes_after_flush_seconds_and_takes_everything_finished_per_wake_up(tmp_path, writer_waits):
    node, dl = _node(tmp_path, write_batch=4, flush_seconds=0.3)
    node.inflight = {"still/0": None}

    async def script():
        t0 = time.monotonic()
        _finish(node, [_traj(i) for i in range(10)])  # one wake-up: batches of 4, 4, then 2 held
        while sum(len(ids) for _, ids in dl.batches) < 10:
            assert time.monotonic() - t0 < HUNG_S, "the writer never flushed the partial batch"
            await asyncio.sleep(0.01)
        return t0

    asyncio.run(_drive(node, script))
    sizes = [len(ids) for _, ids in dl.batches]
    assert sizes == [4, 4, 2]
    # the partial batch went out because its oldest waited flush_seconds, not earlier
    assert writer_waits.ends[-1:] == ["flush_seconds"]
    assert dl.batches[2][0] - dl.batches[1][0] >= 0.25
    assert sorted(i for _, ids in dl.batches for i in ids) == sorted(f"g{i}/0" for i in range(10))


class _DeadEngine:
    """An engine whose every request fails as a dead engine process's do, and which cannot be
    restarted (the capabilities of the engine protocol)."""

    version = 0
    pid = None
    dead = None
    restartable = False

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    async def generate(self, prompt, params):
        raise EngineProcessError("the engine process exited with code -9; see the worker log")


@pytest.mark.timeout(60)
def test_a_dead_engine_process_stops_the_node_leasing(tmp_path, tiny_model):
    """A node whose engine process died fails the episode it was running and stops leasing, so
    the data layer hands the tasks to other nodes instead of this node failing them all."""
    from astraflow.rollout.workflows import make_workflow
    from astraflow.workloads.base import make_workload
    from astraflow.rollout.engine import SamplingParams

    node, dl = _node(tmp_path)
    from transformers import AutoTokenizer

    node.engines = {"p": _DeadEngine(AutoTokenizer.from_pretrained(str(tiny_model)))}
    node.workflow = make_workflow("single_turn", make_workload("math", {}, 0), SamplingParams(), "n0")
    task = RolloutTask(task_id="g0/0", group_id="g0", policies=("p",), workflow="single_turn",
                       prompt=make_workload("math", {}, 0).tasks("train")[0], kind="train")
    node.inflight[task.task_id] = task

    async def run():
        node._slot_free = asyncio.Event()
        await node._episode(task)
        await node._recovery

    asyncio.run(run())
    assert dl.failed and dl.failed[0][0] == "g0/0" and "exited with code -9" in dl.failed[0][1]
    assert node.draining and "exited with code -9" in node.error
    assert not node.inflight


@pytest.mark.timeout(180)
def test_a_node_restarts_a_dead_engine_process_with_the_newest_weights(tmp_path, tiny_model):
    """The engine process is killed (SIGKILL, by its PID) while the node runs an episode: the
    episode's task fails (the data layer requeues it), the node starts a new engine process,
    loads the newest committed version into it and goes on; once ``rollout.engine_restarts``
    is spent, a death stops the node leasing instead."""
    import os
    import signal

    import torch

    from astraflow.models import load_model
    from astraflow.rollout.process_engine import ProcessEngine
    from astraflow.rollout.weight_sync import WeightPuller
    from astraflow.rollout.workflows import make_workflow
    from astraflow.workloads.base import make_workload
    from astraflow.rollout.engine import SamplingParams
    from storage.weights import WeightStore

    node, dl = _node(tmp_path, engine_restarts=1, weight_poll_seconds=0.05)
    model, _ = load_model(str(tiny_model))
    store = WeightStore(tmp_path / "weights")
    store.publish("p", 3, {k: v + 0.01 for k, v in model.state_dict().items()}, meta={"layout": "hf"})
    engine = ProcessEngine(str(tiny_model), max_batch_size=8, device="cpu")
    node.engines = {"p": engine}
    node.puller = WeightPuller(str(tmp_path / "weights"), node.engines)
    workload = make_workload("math", {}, 0)
    node.workflow = make_workflow("single_turn", workload, SamplingParams(max_new_tokens=300), "n0")
    tasks = [RolloutTask(task_id=f"g0/{i}", group_id="g0", policies=("p",), workflow="single_turn",
                         prompt=workload.tasks("train")[i], kind="train") for i in range(3)]

    async def episode_killed(task, publish=None):
        # The engine is paused (SIGSTOP) before the episode asks it for tokens, so the episode is
        # still waiting on it when it dies, however fast the machine samples 300 tokens.
        os.kill(engine.pid, signal.SIGSTOP)  # our own child, by its PID
        node.inflight[task.task_id] = task
        ep = asyncio.ensure_future(node._episode(task))
        await asyncio.sleep(0.3)
        answered = ep.done()
        os.kill(engine.pid, signal.SIGKILL)  # kills a stopped process too (before any assert can fail)
        assert not answered, "the episode should be waiting on the paused engine"
        if publish is not None:  # a version committed while the engine is dead: the watcher meets it
            store.publish("p", publish, {k: v + 0.01 * publish for k, v in model.state_dict().items()},
                          meta={"layout": "hf"})
        await asyncio.wait_for(ep, 30)
        await asyncio.wait_for(node._recovery, 120)

    async def run():
        node._slot_free = asyncio.Event()
        node._finished, node._finished_event, node._slot_free = [], asyncio.Event(), asyncio.Event()
        watcher = asyncio.create_task(node._watch_weights())  # it polls while the engine is dead
        deadline = time.monotonic() + 30
        while engine.version != 3:  # the watcher loads the newest committed version
            assert time.monotonic() < deadline, f"the engine is still at v{engine.version}"
            await asyncio.sleep(0.02)
        await episode_killed(tasks[0], publish=4)
        assert [t for t, _ in dl.failed] == ["g0/0"] and "exited with code -9" in dl.failed[0][1]
        assert node.counters["engine_restarts"] == 1 and not node.draining and node.error is None
        assert engine.dead is None and engine.version == 4  # caught up before leasing again
        # the weight watcher outlived the dead engine: it loads the next version
        store.publish("p", 5, {k: v + 0.05 for k, v in model.state_dict().items()}, meta={"layout": "hf"})
        for _ in range(100):
            if engine.version == 5:
                break
            await asyncio.sleep(0.1)
        assert engine.version == 5 and not watcher.done()
        watcher.cancel()
        node.inflight[tasks[1].task_id] = tasks[1]
        await node._episode(tasks[1])  # served by the new process, with v5
        assert [t.task_id for t, _ in node._finished] == ["g0/1"]
        seq = node._finished[0][0].sequences[0]
        assert set(seq.versions[seq.loss_mask].tolist()) == {5}
        await episode_killed(tasks[2])  # no restarts left
        assert node.draining and "exited with code -9" in node.error

    torch.set_num_threads(1)
    try:
        asyncio.run(run())
    finally:
        engine.close()


class _DiesWhileStarting:
    """A dead engine process whose next ``deaths`` starts die while loading the model (as one
    killed or out of memory then does), and which serves after that."""

    version = 0
    pid = None
    restartable = True

    def __init__(self, deaths: int):
        self.dead: str | None = "the engine process exited with code -9; see the worker log"
        self.deaths, self.starts = deaths, 0

    def restart(self):
        self.starts += 1
        if self.starts <= self.deaths:
            raise EngineProcessError("the engine process exited with code -9 while loading m; see the worker log")
        self.dead = None


@pytest.mark.timeout(30)
@pytest.mark.parametrize("budget, serves", [(3, True), (2, False)])
def test_an_engine_process_that_dies_while_it_restarts_is_started_again_within_the_budget(tmp_path, budget, serves):
    """A second death while the new process loads costs one more restart of
    ``rollout.engine_restarts``: within it the node goes on serving, past it it stops leasing."""
    from types import SimpleNamespace

    node, _ = _node(tmp_path, engine_restarts=budget)
    engine = _DiesWhileStarting(deaths=2)
    node.engines = {"p": engine}
    node.puller = SimpleNamespace(poll=lambda: 1)
    asyncio.run(node._recover(EngineProcessError(engine.dead)))
    assert engine.starts == min(budget, 3) and node.counters["engine_restarts"] == min(budget, 3)
    if serves:
        assert engine.dead is None and not node.draining and node.error is None
        assert node.counters["weight_loads"] == 1  # the newest weights before leasing again
    else:
        assert node.draining and "restarting it failed" in node.error and "while loading" in node.error


def test_an_evaluation_task_waits_for_its_own_policy_version_only(tmp_path):
    """An evaluation round pins the version of the policy it evaluates (the first of the task);
    a second policy that is behind must not hold it up: it may only catch up by training on
    rollouts that waiting evaluation tasks would keep off the node (a deadlock seen with
    solver at v60, verifier at v57)."""
    from types import SimpleNamespace

    node, _ = _node(tmp_path)
    node.engines = {"solver": SimpleNamespace(version=60), "verifier": SimpleNamespace(version=57)}
    asyncio.run(asyncio.wait_for(node._wait_for_version("solver", 60, timeout=5), 2))
    with pytest.raises(TimeoutError, match="solver v61"):
        asyncio.run(node._wait_for_version("solver", 61, timeout=0.3))


@pytest.mark.timeout(60)
def test_writes_the_next_batch_while_the_previous_commit_is_flushed(tmp_path, monkeypatch, writer_waits):
    """While a batch's flush round is held, the writer writes the next batches (their bytes) and
    completes none of them until each one's commit is durable; then all are completed."""
    import threading

    import storage.trajectories.backends as backends

    held, started, real = threading.Event(), threading.Event(), backends.sync_together

    def slow_disk(data_files=(), full=()):
        started.set()
        assert held.wait(30), "the test never released the flush round"
        real(data_files, full)

    monkeypatch.setattr(backends, "sync_together", slow_disk)
    node, dl = _node(tmp_path, write_batch=2, flush_seconds=30.0)
    node.inflight = {"still/0": None}  # episodes are still generating: write full batches only
    submitted = []
    submit = node.writer.submit
    node.writer.submit = lambda rows: submitted.append(len(rows)) or submit(rows)

    async def script():
        _finish(node, [_traj(i) for i in range(2)])
        t0 = time.monotonic()
        while not started.is_set():
            assert time.monotonic() - t0 < HUNG_S, "the first batch was never flushed"
            await asyncio.sleep(0.01)
        _finish(node, [_traj(i) for i in range(2, 6)])  # two more batches while the first flushes
        while len(submitted) < 3:
            assert time.monotonic() - t0 < HUNG_S, "the writer waited for the first commit before writing on"
            await asyncio.sleep(0.01)
        assert dl.batches == [] and len(node.writing) == 6  # nothing completed before it is durable
        held.set()
        while sum(len(ids) for _, ids in dl.batches) < 6:
            assert time.monotonic() - t0 < HUNG_S, "the batches were not completed once their commits were durable"
            await asyncio.sleep(0.01)
        node.inflight = {}

    asyncio.run(_drive(node, script))
    assert submitted == [2, 2, 2]
    assert "flush_seconds" not in writer_waits.ends  # full batches, each written as it filled
    assert sorted(i for _, ids in dl.batches for i in ids) == [f"g{i}/0" for i in range(6)]
    assert not node.writing and node.counters["episodes"] == 6


def test_numpy_values_in_a_trajectorys_metadata_are_stored_not_fatal():
    """A custom workflow's rewards and statistics as numpy values: stored as plain JSON numbers
    (the node's writer encodes them; an error there would lose its whole batch)."""
    import json

    import numpy as np

    traj = make_trajectory(RolloutTask(task_id="g0/0", group_id="g0", policies=("p",), workflow="single_turn",
                                       prompt={}, kind="train"), 1.0)
    seq = traj.sequences[0]
    traj = type(traj)(**{**traj.__dict__, "sequences": (type(seq)(**{**seq.__dict__,
                      "rewards": {"correct": np.float32(1.0), "parts": np.array([0.5, 0.5])}}),)})
    meta = json.loads(traj.to_stored()[0].meta)
    assert meta["rewards"] == {"correct": 1.0, "parts": [0.5, 0.5]}


@pytest.mark.timeout(60)
def test_a_trajectory_that_cannot_be_stored_fails_its_own_episode_not_the_nodes_batch(tmp_path):
    """A custom workflow's statistics with keys of mixed types (or a value that holds itself)
    cannot be written as sorted JSON: that episode fails, named, and the others are written."""
    node, dl = _node(tmp_path, write_batch=1000, flush_seconds=0.05)
    cyclic: dict = {}
    cyclic["self"] = cyclic
    bad = {"g0/0": {1: "a", "b": 2}, "g1/0": cyclic}

    class Workflow:
        async def run_episode(self, engines, task):
            traj = _traj(int(task.group_id[1:]))
            return type(traj)(**{**traj.__dict__, "stats": bad.get(task.task_id, {"turns": 1})})

    node.workflow = Workflow()
    tasks = [RolloutTask(task_id=f"g{i}/0", group_id=f"g{i}", policies=("p",), workflow="single_turn",
                         prompt={"q": i}, kind="train") for i in range(3)]

    async def script():
        node._slot_free = asyncio.Event()
        for t in tasks:
            node.inflight[t.task_id] = t
        await asyncio.gather(*(node._episode(t) for t in tasks))
        while not dl.batches:
            await asyncio.sleep(0.01)

    asyncio.run(_drive(node, script))
    assert sorted(t for t, _ in dl.failed) == ["g0/0", "g1/0"]
    assert all("cannot be stored as JSON" in why and "stats" in why for _, why in dl.failed)
    assert [ids for _, ids in dl.batches] == [["g2/0"]] and node.error is None and not node.writing


@pytest.mark.timeout(60)
def test_a_node_that_rotates_many_segments_keeps_only_its_open_ones(tmp_path):
    """A node of a long run fills segment after segment: each is reported done once, and the
    node (and its writer) keep nothing of those reported, so what they hold stays bounded."""
    from storage.trajectories.rotating import RotatingWriter

    node, dl = _node(tmp_path, write_batch=2, flush_seconds=0.05)
    node.writer = RotatingWriter(open_trajectory_store(dl.store_url, "a"), "n0", batch_size=2, max_entries=2)
    reported: list[str] = []

    def segments_done(segments):
        reported.extend(segments)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(None)
        return fut

    dl.segments_done = segments_done

    async def script():
        for k in range(12):  # each batch of two fills a segment: the next one closes it
            _finish(node, [_traj(2 * k), _traj(2 * k + 1)])
            while sum(len(ids) for _, ids in dl.batches) < 2 * k + 2:
                await asyncio.sleep(0.01)

    asyncio.run(_drive(node, script))
    assert reported == ["n0"] + [f"n0.{i}" for i in range(1, 11)]  # every closed one, once, in order
    assert node.writer.closed_segments == [] and node._segments_closed == []
    assert set(node._segment_batches) <= {"n0.11"}  # the open segment's count only


def test_a_mixture_sources_episode_is_stored_with_its_source(tmp_path):
    """A single-turn episode keeps no episode log, so its payload's ``source`` (a ``mix`` run's
    source) is stamped on the trajectory and stored: the episode viewer shows and filters by it."""
    import json

    node, _ = _node(tmp_path)

    class Stub:
        async def run_episode(self, engines, task):
            return make_trajectory(task, 1.0)

    node.workflow = Stub()
    node._finished, node._finished_event, node._slot_free = [], asyncio.Event(), asyncio.Event()
    for i, payload in enumerate([{"q": 1, "source": "add2"}, {"q": 2}]):
        task = RolloutTask(task_id=f"g{i}/0", group_id=f"g{i}", policies=("p",), workflow="single_turn",
                           prompt=payload, kind="train")
        asyncio.run(node._episode(task))
    (a, rows_a), (b, rows_b) = node._finished
    assert (a.source, json.loads(rows_a[0].meta)["source"]) == ("add2", "add2")
    assert b.source is None and "source" not in json.loads(rows_b[0].meta)
