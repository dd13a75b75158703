"""The trainer reads the rows of the batches the data layer serves by reference, from the
trajectory store the nodes write, and trains on complete batches; a row it cannot read stops it
with the row named, and nothing of that batch is consumed.

A real ``DataLayer`` runs on an event loop in a thread of this process; the Dask actor handle
(the process boundary) is replaced by a handle that runs its methods on that loop and answers
with futures, as an actor call does. The store is on disk; the backend is the sim backend."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time

from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.layer import DataLayer
from astraflow.training.config import TrainerConfig
from astraflow.training.trainer import Trainer
from astraflow.workloads.config import EvalConfig, WorkloadConfig

from tests.dataflow.helpers import make_trajectory, store_and_ref


class _Handle:
    """An actor handle: each method call runs on the layer's loop and returns a future."""

    _worker = "test"  # ``bind`` leaves a bound handle alone

    def __init__(self, layer: DataLayer, loop: asyncio.AbstractEventLoop):
        self._layer, self._loop = layer, loop

    def __getattr__(self, name):
        method = getattr(self._layer, name)
        return lambda *a, **k: asyncio.run_coroutine_threadsafe(method(*a, **k), self._loop)


def _setup(tmp_path, steps: int):
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    store = str(tmp_path / "trajectories")
    layer = DataLayer(
        dataflow=DataflowConfig(batch_size=8), policies=["p"], store_url=store, metrics_path=None,
        workload=WorkloadConfig(name="math", params={"digits": 1, "num_test": 10}, group_size=4,
                                eval=EvalConfig(every=0)),
        max_steps=steps)
    handle = _Handle(layer, loop)
    trainer = Trainer(policy="p", cfg=TrainerConfig(backend="sim", sim_step_seconds=0.0, batch_timeout_s=30),
                      model_path="unused", weights_root=str(tmp_path / "weights"), keep_versions=steps + 1,
                      data_layer=handle, max_steps=steps, store_url=store)
    return loop, layer, handle, trainer


def _roll(handle: _Handle, layer: DataLayer, node: str, n: int = 8) -> int:
    tasks = handle.lease(node, n).result(10)
    trajs = [make_trajectory(t, float(int(t.task_id.split("/")[1]) % 2), node=node) for t in tasks]
    if trajs:
        handle.complete(store_and_ref(layer.store.writer(node), trajs)).result(10)
    return len(trajs)


def _until(cond, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_trainer_reads_the_rows_it_trains_on(tmp_path):
    loop, layer, handle, trainer = _setup(tmp_path, steps=3)
    try:
        trainer.start()
        for i in range(60):
            if trainer.state()["done"] or trainer.state()["error"]:
                break
            _roll(handle, layer, f"n{i % 2}")
        _until(lambda: trainer.state()["done"] or trainer.state()["error"])
        st = trainer.stop()
        assert st["error"] is None and st["version"] == 3
        # the sim backend counted the policy's tokens of complete batches: 8 rows x 4 generated
        assert st["last_metrics"]["tokens"] == 32.0 and st["read_s"] > 0
        assert layer.counts["p"]["consumed"] == 24
    finally:
        loop.call_soon_threadsafe(loop.stop)


def test_a_row_the_trainer_cannot_read_stops_it_named_and_nothing_is_consumed(tmp_path):
    loop, layer, handle, trainer = _setup(tmp_path, steps=3)
    try:
        _roll(handle, layer, "n0")
        shutil.rmtree(tmp_path / "trajectories" / "segments" / "n0")  # the store lost what n0 wrote
        trainer.start()
        _until(lambda: trainer.state()["error"])
        st = trainer.stop()
        assert st["error"].startswith("RowsUnreadable: batch v0 of p: 8 of its 8 rows cannot be read")
        assert "n0[0] (task g0000001/0)" in st["error"] and st["version"] == 0
        status = handle.state().result(10)
        # served, never committed: counted as consumed nowhere
        assert status["counts"]["p"].get("consumed", 0) == 0 and status["ledger"]["states"].get("consumed", 0) == 0
        assert handle.trainer_restarted("p", 0).result(10)["put_back"] == 8  # a new trainer gets them back
    finally:
        loop.call_soon_threadsafe(loop.stop)
