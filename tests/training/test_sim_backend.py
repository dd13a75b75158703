"""The sim trainer backend: a step takes its configured time (on an injected sleep) and
publishes a real, tiny committed version into the weight store."""

from __future__ import annotations

import numpy as np
import pytest

from astraflow.batches import Batch
from astraflow.training.config import TrainerConfig
from astraflow.training.sim_backend import SimBackend
from astraflow.training.trainer import make_backend
from storage.weights import WeightStore
from tests.dataflow.helpers import make_trajectory
from astraflow.batches import BatchItem
from astraflow.contracts import RolloutTask


def _batch(n: int = 4) -> Batch:
    items = []
    for i in range(n):
        task = RolloutTask(task_id=f"g/{i}", group_id="g", policies=("p",), workflow="sim", prompt={}, kind="train")
        seq = make_trajectory(task, reward=float(i % 2)).sequences[0]
        items.append(BatchItem(sequence=seq, loss_mask=seq.loss_mask, group_mean=0.5, group_std=0.5, group_size=n,
                               staleness=0, task_id=task.task_id))
    return Batch(policy="p", version=0, items=tuple(items))


def test_a_step_takes_its_time_and_versions_are_published(tmp_path):
    slept = []
    backend = SimBackend(step_seconds=0.5, seconds_per_token=0.01, sleep=slept.append)
    batch = _batch()
    tokens = sum(int(i.loss_mask.sum()) for i in batch.items)
    metrics = backend.train_step(batch)
    assert slept == [0.5 + 0.01 * tokens] and metrics["tokens"] == tokens and np.isfinite(metrics["loss"])
    store = WeightStore(tmp_path)
    backend.publish(store, "p", 1)
    assert store.latest("p").version == 1 and store.manifest("p", 1)["meta"]["sim"] is True
    again = SimBackend()
    again.load_state_dict(store.load("p", 1))
    assert again.steps == 1


def test_the_trainer_builds_it_from_its_config():
    backend = make_backend(TrainerConfig(backend="sim", sim_step_seconds=0.2), "unused", 0)
    assert isinstance(backend, SimBackend) and backend.step_seconds == 0.2


def test_a_step_schedule_changes_the_step_time_mid_run():
    cfg = TrainerConfig(backend="sim", sim_step_seconds=1.0, sim_step_schedule={4: 3.0, 2: 0.1})
    assert list(cfg.sim_step_schedule) == [2, 4]
    backend = make_backend(cfg, None, 0)
    slept = []
    backend._sleep = slept.append
    for _ in range(6):
        backend.train_step(Batch(policy="p", version=0, items=()))
    assert slept == [1.0, 1.0, 0.1, 0.1, 3.0, 3.0]
    with pytest.raises(ValueError, match="from_step: seconds"):
        TrainerConfig(backend="sim", sim_step_schedule={-1: 1.0})


def test_a_snapshot_is_published_as_it_was_taken(tmp_path):
    backend = SimBackend(step_seconds=0.0)
    backend.train_step(_batch())
    snap = backend.snapshot()
    backend.train_step(_batch())  # the next step runs while the snapshot is published
    store = WeightStore(tmp_path)
    backend.publish(store, "p", 1, state=snap)
    assert backend.supports_snapshot and store.manifest("p", 1)["meta"]["train_steps"] == 1
    assert int(store.load("p", 1)["sim.steps"][0]) == 1
