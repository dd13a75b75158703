"""The trainer-centred baseline (``run.mode: sync``) over a real gated data layer: the real
sync driver, a scripted RaaS node and trainer. Each iteration rolls out what its batch takes,
of every source, and no more."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading
import uuid

import pytest

from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.layer import DataLayer
from astraflow.runtime.sync_driver import drive_sync
from astraflow.workloads.config import EvalConfig, WorkloadConfig
from tests.dataflow.helpers import make_trajectory, store_and_ref
from tests.dataflow.test_mix import sources


class _Harness:
    """A gated data layer on an event loop of its own, reached as the driver reaches an actor
    (each call a future), a node that completes what it leases at the trainer's version, and a
    trainer that takes a batch per step (its batches' sources recorded)."""

    policies = ["p"]

    def __init__(self, weights: dict[str, float], group_size: int, batch_size: int):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def build() -> DataLayer:
            return DataLayer(
                dataflow=DataflowConfig(batch_size=batch_size),
                workload=WorkloadConfig(name="mix", params={"sources": sources(**weights)}, group_size=group_size,
                                        eval=EvalConfig(every=0)),
                policies=list(self.policies), store_url=f"memory://{uuid.uuid4().hex}", metrics_path=None,
                max_steps=100, gated=True)
        self.dl = self.call(build()).result()
        self.stop = False
        self.call(self._node())
        self.version, self.batches = 0, []

    def call(self, coro) -> cf.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _node(self) -> None:
        writer = self.dl.store.writer("n0")
        while not self.stop:
            tasks = await self.dl.lease("n0", 64)
            if tasks:
                await self.dl.complete(store_and_ref(writer, [
                    make_trajectory(t, float(int(t.task_id.split("/")[1]) % 2), version=self.dl.versions["p"])
                    for t in tasks]))
            await asyncio.sleep(0.005)

    # the handles the driver holds
    def handle(self):
        harness = self

        class Handle:
            def __getattr__(self, name):
                return lambda *a, **k: harness.call(getattr(harness.dl, name)(*a, **k))
        return Handle()

    def trainer(self):
        harness = self

        class Trainer:
            def state(self):
                return _done({"version": harness.version})

            def step(self):
                batch = harness.call(harness.dl.next_batch("p", harness.version, timeout=5)).result()
                harness.batches.append(batch.metrics["consumed_by_source"])
                harness.version += 1
                harness.call(harness.dl.published("p", harness.version)).result()
                return _done({})
        return Trainer()

    def close(self) -> None:
        self.stop = True
        self.loop.call_soon_threadsafe(self.loop.stop)


def _done(value) -> cf.Future:
    fut = cf.Future()
    fut.set_result(value)
    return fut


@pytest.mark.parametrize("weights, group_size, batch_size", [
    ({"a": 3, "b": 1}, 4, 8),     # 1.5 groups of a per batch: the batches alternate 8/0 and 4/4
    ({"a": 1, "b": 1, "c": 1}, 4, 8),  # a third of two groups: some source has none in a batch
    ({"a": 2, "b": 1}, 4, 16),
])
def test_each_sync_iteration_rolls_out_what_its_batch_takes(weights, group_size, batch_size):
    h = _Harness(weights, group_size, batch_size)
    try:
        steps = 6
        groups = batch_size // group_size
        iterations = drive_sync(h.handle(), {"p": h.trainer()}, lambda: [], batch_size, groups, steps, 20.0)
        assert len(iterations) == steps and all(sum(b.values()) == batch_size for b in h.batches)
        total = sum(weights.values())
        served = {s: sum(b[s] for b in h.batches) for s in weights}
        for s, w in weights.items():  # the weights' shares, within one group
            assert abs(served[s] - steps * batch_size * w / total) <= group_size
        made = dict(h.dl.mixer.groups_created)
        assert sum(made.values()) == steps * groups  # one batch of groups an iteration, none beyond
        assert h.call(h.dl.state()).result()["budget"] == 0
    finally:
        h.close()


def test_a_sync_run_resumed_with_its_groups_on_their_way_trains_on_the_versions_it_rolls_out():
    """A resumed run restores the groups its previous incarnation opened (rolling out or
    buffered): opened on top of them, one batch more was always ahead, and every later
    iteration trained on rows of the version before (staleness 1 in a baseline meant to have none)."""
    h = _Harness({"a": 1}, 4, 8)
    try:
        h.call(h.dl.open_iteration(2)).result()  # what the killed incarnation had opened
        iterations = drive_sync(h.handle(), {"p": h.trainer()}, lambda: [], 8, 2, 4, 20.0)
        assert len(iterations) == 4 and len(h.batches) == 4
        assert sum(h.dl.mixer.groups_created.values()) == 4 * 2  # the restored batch was the first one
        st = h.call(h.dl.state()).result()
        assert st["buffers"]["p"] == 0 and st["outstanding_groups"] == 0
    finally:
        h.close()
