"""A RaaS node running a ``vllm`` engine: when vLLM's engine core dies mid-episode, the episode's
task fails (the data layer requeues it), the node restarts the engine, loads the newest committed
version into it and goes on, exactly as with the HF engine's process (``tests/rollout/
test_node_writer.py``). The node's loop is driven directly; the data-layer handle is the stand-in
of that test (the process boundary)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (bash tests/run_vllm.sh runs this tier)")

from astraflow.contracts import RolloutTask
from astraflow.models import load_model
from astraflow.rollout.config import EngineConfig
from astraflow.rollout.engine import SamplingParams
from astraflow.rollout.engines import make_engine
from astraflow.rollout.weight_sync import WeightPuller
from astraflow.rollout.workflows import make_workflow
from astraflow.workloads.base import make_workload
from storage.weights import WeightStore
from tests.rollout.test_node_writer import _node

from .conftest import close_engine, engine_options, publish


@pytest.mark.timeout(900)
def test_a_node_restarts_a_dead_vllm_engine_with_the_newest_weights(tmp_path, vllm_models):
    node, dl = _node(tmp_path, engine_restarts=1, weight_poll_seconds=0.05)
    store = WeightStore(tmp_path / "weights")
    m1, _ = load_model(vllm_models["v1"])
    publish(store, "p", 1, m1)
    engine = make_engine(EngineConfig(type="vllm", max_batch=8, threads=2, vllm=engine_options()),
                         str(vllm_models["v0"]))
    node.engines = {"p": engine}
    node.puller = WeightPuller(str(tmp_path / "weights"), node.engines)
    workload = make_workload("math", {}, 0)
    node.workflow = make_workflow("single_turn", workload, SamplingParams(max_new_tokens=400), "n0")
    tasks = [RolloutTask(task_id=f"g0/{i}", group_id="g0", policies=("p",), workflow="single_turn",
                         prompt=workload.tasks("train")[i], kind="train") for i in range(2)]

    async def wait_serving(version: int) -> None:
        deadline = time.monotonic() + 300
        while engine.serving_version != version:
            assert time.monotonic() < deadline, f"the engine still serves v{engine.serving_version}"
            await asyncio.sleep(0.05)

    async def run():
        node._slot_free = asyncio.Event()
        node._finished, node._finished_event = [], asyncio.Event()
        watcher = asyncio.create_task(node._watch_weights())
        await wait_serving(1)
        node.inflight[tasks[0].task_id] = tasks[0]
        ep = asyncio.ensure_future(node._episode(tasks[0]))
        while not engine._running:  # the episode's request is in the engine
            await asyncio.sleep(0.01)
        os.kill(engine.pid, signal.SIGKILL)  # the engine core this test started, by its pid
        await asyncio.wait_for(ep, 60)
        await asyncio.wait_for(node._recovery, 600)
        assert [t for t, _ in dl.failed] == ["g0/0"] and "engine core died" in dl.failed[0][1]
        assert node.counters["engine_restarts"] == 1 and not node.draining and node.error is None
        await wait_serving(1)  # the restarted engine caught up to the newest version
        watcher.cancel()
        node.inflight[tasks[1].task_id] = tasks[1]
        await node._episode(tasks[1])
        seq = node._finished[0][0].sequences[0]
        assert [t.task_id for t, _ in node._finished] == ["g0/1"]
        assert set(seq.versions[seq.loss_mask].tolist()) == {1}

    try:
        asyncio.run(run())
    finally:
        close_engine(engine)
