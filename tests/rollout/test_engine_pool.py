"""Several engines per policy on one RaaS node (``EnginePool``): real engine processes on the
CPU with the tiny model. Requests are spread over the replicas and both generate; every
weight version reaches every replica (each one's log-probs are the new version's); a replica
that dies is restarted by the node while the other keeps serving. And the plan: one engine
per GPU of the worker, threads split between replicas on a CPU worker."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest
import torch

from astraflow.rollout.config import EngineConfig
from astraflow.rollout.engine import SamplingParams
from astraflow.rollout.engine_pool import EnginePool, plan_replicas, replicas_of, serving
from astraflow.rollout.engines import make_engine
from astraflow.rollout.hf_engine import HFEngine
from astraflow.rollout.weight_sync import WeightPuller
from storage.weights import WeightStore

PROMPTS = ["1+2=", "12+34=", "7+88=", "a longer prompt: 55+44=", "3+4=", "90+9="]
GREEDY = SamplingParams(max_new_tokens=8, greedy=True)


def _gather(engine, prompts, params):
    async def main():
        return await asyncio.gather(*[engine.generate(p, params) for p in prompts])

    return asyncio.run(main())


def _publish(store: WeightStore, tiny_model, version: int) -> dict[str, torch.Tensor]:
    """Commit ``version``: the tiny model's weights shifted by ``0.01 * version``."""
    from astraflow.models import load_model

    model, _ = load_model(str(tiny_model))
    state = {k: v + 0.01 * version for k, v in model.state_dict().items()}
    store.publish("p", version, state, meta={"layout": "hf"})
    return state


def _wait(what, cond, timeout=30.0):
    """Wait for ``cond()`` (a deadline, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} within {timeout:.0f}s"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def pool(tiny_model):
    """Two engine processes, shared by the tests below (each loads the weight version it needs)."""
    torch.set_num_threads(1)
    engine = make_engine(EngineConfig(replicas=2, device="cpu", max_batch=8, threads=2), str(tiny_model), seed=3)
    yield engine
    engine.close()
    assert all(not r._proc.is_alive() for r in replicas_of(engine))


def test_the_plan_uses_every_gpu_of_the_worker_and_splits_cpu_threads():
    four = plan_replicas(EngineConfig(threads=8), gpus=4, cuda_seen=4, node_visible="4,5,6,7", seed=10)
    assert [p.visible_devices for p in four] == ["4", "5", "6", "7"]  # each engine process sees its own GPU
    assert [p.device_in_node for p in four] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [p.threads for p in four] == [2] * 4 and [p.seed for p in four] == [10, 11, 12, 13]
    cpu = plan_replicas(EngineConfig(replicas=3, threads=8), gpus=0, cuda_seen=0, node_visible=None)
    assert len(cpu) == 3 and {p.threads for p in cpu} == {2} and {p.visible_devices for p in cpu} == {None}
    assert len(plan_replicas(EngineConfig(), gpus=0, cuda_seen=2, node_visible=None)) == 1  # a CPU partition
    assert len(plan_replicas(EngineConfig(), gpus=2, cuda_seen=0, node_visible=None)) == 1  # no GPU seen: CPU
    pinned = plan_replicas(EngineConfig(device="cuda:1"), gpus=4, cuda_seen=4, node_visible=None)
    assert [(p.device, p.visible_devices) for p in pinned] == [("cuda:1", None)]  # an explicit GPU: one engine
    shared = plan_replicas(EngineConfig(replicas=3), gpus=2, cuda_seen=2, node_visible=None)
    assert [p.visible_devices for p in shared] == ["0", "1", "0"]  # more engines than GPUs: in turn
    # an engine type with tensor parallelism gets its GPUs in groups (the hf engine refuses it)
    tp = plan_replicas(EngineConfig.model_construct(**{**EngineConfig().model_dump(), "tensor_parallel": 2}),
                       gpus=4, cuda_seen=4, node_visible=None)
    assert [p.visible_devices for p in tp] == ["0,1", "2,3"]


def test_tensor_parallel_with_the_hf_engine_is_a_config_error_naming_the_fix():
    with pytest.raises(ValueError, match="tensor_parallel 2: the hf engine .* set tensor_parallel: 1"):
        EngineConfig(tensor_parallel=2)


@pytest.mark.timeout(180)
def test_two_replicas_split_the_requests_and_both_generate(pool, tiny_model):
    assert isinstance(pool, EnginePool) and len(pool.replicas) == 2
    a, b = pool.replicas
    assert a.pid != b.pid and a._args[4] == b._args[4] == 1  # own processes, threads split
    prompts = [pool.tokenizer(p)["input_ids"] for p in PROMPTS]
    routed, served = list(pool.routed), [r.stats()["requests"] for r in pool.replicas]
    out = _gather(pool, prompts, GREEDY)
    assert all(len(g.tokens) > 0 for g in out)
    assert [n - m for n, m in zip(pool.routed, routed)] == [3, 3]  # in flight together: spread evenly
    assert [r.stats()["requests"] - m for r, m in zip(pool.replicas, served)] == [3, 3]
    # the replicas hold the same weights: a greedy request comes out the same from either
    one = [r.generate for r in pool.replicas]
    x, y = (asyncio.run(gen(prompts[1], GREEDY)) for gen in one)
    np.testing.assert_array_equal(x.tokens, y.tokens)


@pytest.mark.timeout(180)
def test_a_weight_version_reaches_every_replica(pool, tiny_model, tmp_path):
    store = WeightStore(tmp_path / "weights")
    state = _publish(store, tiny_model, 3)
    puller = WeightPuller(str(tmp_path / "weights"), {"p": pool})
    assert puller.poll() == 1 and pool.version == 3
    reference = HFEngine(str(tiny_model), max_batch_size=8, version=0, device="cpu")
    reference.load_weights(state, 3)
    prompts = [pool.tokenizer(p)["input_ids"] for p in PROMPTS]
    want = _gather(reference, prompts, GREEDY)
    for replica in pool.replicas:  # each replica's tokens and log-probs are the new version's
        got = _gather(replica, prompts, GREEDY)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.tokens, w.tokens)
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
            assert set(g.versions.tolist()) == {3}
    _wait("the load records of both replicas", lambda: len(puller.recent(5)) == 2)  # read in each process
    assert sorted(r["replica"] for r in puller.recent(5)) == [0, 1]
    assert {int(v) for g in _gather(pool, prompts, GREEDY) for v in g.versions} == {3}


@pytest.mark.timeout(240)
def test_a_dead_replica_is_restarted_while_the_other_keeps_serving(pool, tiny_model, tmp_path):
    """SIGKILL one replica (by its PID): the node restarts that one only, counted against
    ``rollout.engine_restarts``, catches it up to the newest version, and leases meanwhile
    because the other replica serves; an episode run while it is dead succeeds on the other."""
    from astraflow.contracts import RolloutTask
    from astraflow.rollout.process_engine import EngineProcessError
    from astraflow.rollout.workflows import make_workflow
    from astraflow.workloads.base import make_workload
    from tests.rollout.test_node_writer import _node

    store = WeightStore(tmp_path / "weights")
    _publish(store, tiny_model, 5)
    node, dl = _node(tmp_path, engine_restarts=2, weight_poll_seconds=0.05)
    node.engines = {"p": pool}
    node.puller = WeightPuller(str(tmp_path / "weights"), node.engines)
    node.puller.poll()
    workload = make_workload("math", {}, 0)
    node.workflow = make_workflow("single_turn", workload, SamplingParams(max_new_tokens=8), "n0")
    tasks = [RolloutTask(task_id=f"g0/{i}", group_id="g0", policies=("p",), workflow="single_turn",
                         prompt=workload.tasks("train")[i], kind="train") for i in range(2)]
    first, second = pool.replicas
    first_pid, second_pid = first.pid, second.pid
    _wait("both replicas at v5", lambda: pool.version == 5)

    async def run():
        node._slot_free = asyncio.Event()
        node._finished, node._finished_event = [], asyncio.Event()
        os.kill(second_pid, signal.SIGKILL)  # our own child, by its PID
        while not second.dead:
            await asyncio.sleep(0.02)
        assert serving(node.engines, []) and pool.version == 5
        node.inflight[tasks[0].task_id] = tasks[0]
        await node._episode(tasks[0])  # served by the live replica
        recovery = asyncio.ensure_future(node._recover(EngineProcessError(second.dead)))
        await asyncio.sleep(0)
        assert node._reviving == [second] and serving(node.engines, node._reviving)  # the node still leases
        await asyncio.wait_for(recovery, 120)

    asyncio.run(run())
    assert not dl.failed and [t.task_id for t, _ in node._finished] == ["g0/0"]
    seq = node._finished[0][0].sequences[0]
    assert set(seq.versions[seq.loss_mask].tolist()) == {5}
    assert node.counters["engine_restarts"] == 1 and node.error is None and not node.draining
    assert first.pid == first_pid and second.pid != second_pid and second.dead is None
    assert first.version == second.version == 5
    prompts = [pool.tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    assert {int(v) for g in _gather(second, prompts, GREEDY) for v in g.versions} == {5}
    pids = node._beat_stats()["engine_pids"]
    assert pids == {"p": first_pid, "p#1": second.pid}


@pytest.mark.timeout(120)
def test_replicas_in_the_node_process_take_every_version_too(tiny_model, tmp_path):
    """``rollout.engine.process: false``: the replicas are ``HFEngine``s in the node's process,
    the node reads each version and hands it to every replica."""
    engine = make_engine(EngineConfig(replicas=2, process=False, device="cpu"), str(tiny_model))
    assert isinstance(engine, EnginePool) and all(isinstance(r, HFEngine) for r in engine.replicas)
    _publish(WeightStore(tmp_path / "weights"), tiny_model, 2)
    assert WeightPuller(str(tmp_path / "weights"), {"p": engine}).poll() == 1
    assert [r.version for r in engine.replicas] == [2, 2]
    prompts = [engine.tokenizer(p)["input_ids"] for p in PROMPTS[:4]]
    assert {int(v) for g in _gather(engine, prompts, GREEDY) for v in g.versions} == {2}
    assert engine.routed == [2, 2]


def test_a_single_engine_being_restarted_stops_the_node_leasing():
    """Without a second replica, nothing serves while the engine restarts: no leases."""
    from types import SimpleNamespace

    engine = SimpleNamespace(dead=None)
    assert serving({"p": engine}, []) and not serving({"p": engine}, [engine])
    assert serving({}, [])


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_a_2_gpu_worker_uses_both_gpus(tiny_model):
    """A rollout worker whose partition gives it 2 GPUs runs an engine on each: both devices'
    memory fills while the engines hold the model, and both generate."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    free_before = [torch.cuda.mem_get_info(i)[0] for i in range(2)]
    engine = make_engine(EngineConfig(max_batch=8), str(tiny_model), gpus=2)
    try:
        assert isinstance(engine, EnginePool) and len(engine.replicas) == 2
        assert [r._args[7] for r in engine.replicas] == [str(d) for d in _visible()[:2]]
        prompts = [engine.tokenizer(p)["input_ids"] for p in PROMPTS]
        assert all(len(g.tokens) for g in _gather(engine, prompts, GREEDY))
        assert all(r.stats()["requests"] > 0 for r in engine.replicas)
        used = [free_before[i] - torch.cuda.mem_get_info(i)[0] for i in range(2)]
        assert all(u > 50 * 2**20 for u in used), f"memory taken on each GPU: {used}"  # a context + the model
    finally:
        engine.close()


def _visible() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [d for d in env.split(",") if d] if env else [str(i) for i in range(torch.cuda.device_count())]


@pytest.mark.timeout(120)
def test_a_pool_whose_replicas_are_all_dead_loads_no_version(tiny_model, tmp_path):
    """Both replicas SIGKILLed: a new version is skipped by the dead replicas, and the puller
    does not count it as loaded (the node would take it for new weights on every poll)."""
    engine = make_engine(EngineConfig(replicas=2, device="cpu", max_batch=8, threads=1), str(tiny_model), seed=3)
    try:
        store = WeightStore(tmp_path / "weights")
        _publish(store, tiny_model, 1)
        puller = WeightPuller(str(tmp_path / "weights"), {"p": engine})
        assert puller.poll() == 1
        _wait("both replicas at v1", lambda: engine.version == 1)
        for replica in engine.replicas:
            os.kill(replica.pid, signal.SIGKILL)  # our own children, by their PIDs
        _wait("both replicas seen dead", lambda: all(r.dead for r in engine.replicas))
        _publish(store, tiny_model, 2)
        assert puller.poll() == 0 and puller.poll() == 0 and engine.version == 1
    finally:
        engine.close()


class _NoTasks:
    """The data layer's side of a node's calls, with no task to hand out (in-process)."""

    @staticmethod
    def _answer(value):
        from concurrent.futures import Future

        fut = Future()
        fut.set_result(value)
        return fut

    def heartbeat(self, node, stats):
        return self._answer({"draining": False, "finished": False})

    def lease(self, node, capacity, wait, versions=None):
        return self._answer([])

    def fail(self, task_id, reason, attempt=None):
        return self._answer(None)

    def complete(self, refs):
        return self._answer(0)


class _DeadOnCue:
    """An engine process's stand-in for the node's loop (nothing generates here): it dies when
    told, and a restart takes seconds, as a real engine process's does."""

    loads_versions_itself, pid, restartable, tokenizer = True, None, True, None

    def __init__(self):
        self.dead, self.version = None, 5

    def restart(self):
        time.sleep(3.0)
        self.dead, self.version = None, 0

    def load_version(self, root, policy, version, **kw):
        self.version = version

    def take_load_records(self):
        return []

    def stats(self):
        return {}

    def close(self):
        pass


@pytest.mark.timeout(60)
def test_a_node_restarting_its_engines_paces_its_loop(tmp_path, monkeypatch):
    """While every replica restarts (nothing serves: no lease), new versions keep being
    published: the node's loop still pauses between turns instead of spinning."""
    import threading
    from types import SimpleNamespace

    import astraflow.rollout.node as node_module
    from astraflow.rollout.config import RolloutConfig
    from astraflow.rollout.node import NodeIdentity, RaaSNode
    from astraflow.workloads.config import SamplingConfig

    node = RaaSNode(identity=NodeIdentity(name="n0"), models={"p": "x"}, workload_name="math",
                    rollout=RolloutConfig(capacity=4, lease_wait_seconds=0.5, weight_poll_seconds=0.1),
                    workload_params={}, workload_seed=0, workflow="single_turn", sampling=SamplingConfig(),
                    store_url=str(tmp_path / "trajectories"), weights_root=str(tmp_path / "weights"),
                    data_layer=_NoTasks())
    node.writer = SimpleNamespace(flush=lambda: None)
    replicas = [_DeadOnCue(), _DeadOnCue()]
    node.engines = {"p": EnginePool(replicas)}
    latest = SimpleNamespace(version=5)
    node.puller = WeightPuller(str(tmp_path / "weights"), node.engines)
    node.puller.store = SimpleNamespace(latest=lambda policy: latest, root=str(tmp_path / "weights"))
    turns = []
    real_serving = node_module.serving
    monkeypatch.setattr(node_module, "serving", lambda *a: turns.append(1) or real_serving(*a))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=lambda: loop.run_until_complete(node._guarded()), daemon=True)
    thread.start()
    try:
        time.sleep(0.3)  # empty leases: the node's pacing backs off
        for replica in replicas:
            replica.dead = "killed"
        latest.version = 6  # published while the replicas restart
        time.sleep(0.5)
        before = len(turns)
        time.sleep(1.5)
        assert thread.is_alive() and node.error is None and replicas[0].dead  # still restarting
        assert len(turns) - before < 100, f"{len(turns) - before} turns of the node's loop in 1.5 s"
        assert node.counters["weight_loads"] == 0
    finally:
        node._stop.set()
        thread.join(15)


class _BlockingReplica:
    """A replica whose version load blocks its caller (as a simulated engine's does) until
    every replica of the pool is loading: the pool must load them side by side."""

    loads_versions_itself, dead, tokenizer = True, None, None

    def __init__(self, barrier):
        self.barrier, self.version = barrier, 0

    def load_version(self, weights_root, policy, version, **_):
        self.barrier.wait()  # raises BrokenBarrierError after its timeout if loads run one by one
        self.version = version


def test_the_replicas_of_a_pool_load_a_version_side_by_side():
    import threading

    barrier = threading.Barrier(4, timeout=10)
    pool = EnginePool([_BlockingReplica(barrier) for _ in range(4)])
    pool.load_version("unused", "p", 3)
    assert pool.version == 3 and not barrier.broken
