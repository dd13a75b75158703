"""The numerics guard: a step whose loss or gradient norm is not finite changes no weight and is
counted; too many in a row stop the trainer with a message naming the likely cause; weights that
are not finite are never published (nor saved as the optimiser state a resume would use)."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from astraflow.batches import Batch
from astraflow.training.config import TrainerConfig
from astraflow.training.numerics import NonFiniteError
from astraflow.training.torch_backend import TorchBackend
from astraflow.training.trainer import Trainer
from storage.weights import WeightStore
from tests.training.test_torch_backend import _batch
from tests.training.test_trainer_loop import _DataLayer


def _poisoned(batch: Batch) -> Batch:
    """``batch`` with nan behaviour log-probs: every trained token's ratio, hence the loss, is nan."""
    items = []
    for it in batch.items:
        seq = it.sequence
        items.append(replace(it, sequence=replace(seq, logprobs=np.full_like(seq.logprobs, np.nan))))
    return replace(batch, items=tuple(items))


def _weights(be: TorchBackend) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in be.model.state_dict().items()}


def test_a_nonfinite_step_changes_no_weight_and_is_counted(tiny_model):
    be = TorchBackend(tiny_model, lr=1e-3)
    good = _batch(be.model, be.tokenizer)
    bad = _poisoned(good)
    before = _weights(be)
    for i in (1, 2):
        out = be.train_step(bad)
        assert not np.isfinite(out["loss"])
        assert out["nonfinite_skipped"] == 1.0 and out["nonfinite_skipped_total"] == float(i)
        for k, v in be.model.state_dict().items():
            assert torch.equal(v, before[k]), k
        assert all(p.grad is None for p in be.model.parameters())
        assert not be.optimizer.state  # no AdamW step taken: no moments either
    out = be.train_step(good)  # a finite step after them trains as usual
    assert out["nonfinite_skipped"] == 0.0 and out["nonfinite_skipped_total"] == 2.0
    assert any(not torch.equal(v, before[k]) for k, v in be.model.state_dict().items())


class _Store:
    def __init__(self):
        self.published: list[int] = []

    def publish(self, policy, version, weights, meta=None):
        self.published.append(version)


def test_publish_refuses_weights_that_are_not_finite(tiny_model):
    be = TorchBackend(tiny_model, lr=float("inf"))
    store = _Store()
    be.publish(store, "p", 0)
    out = be.train_step(_batch(be.model, be.tokenizer))  # finite loss; an infinite step
    assert np.isfinite(out["loss"]) and out["nonfinite_skipped"] == 0.0
    with pytest.raises(NonFiniteError, match=r"not publishing v1.*policies\[p\]\.trainer\.lr"):
        be.publish(store, "p", 1)
    with pytest.raises(NonFiniteError):
        be.publish(store, "p", 1, state=be.snapshot())
    assert store.published == [0]


def _run_until_stopped(tr: Trainer, deadline_s: float = 120.0) -> dict:
    tr.start()
    deadline = time.time() + deadline_s
    while not tr.state()["done"] and tr.state()["error"] is None and time.time() < deadline:
        time.sleep(0.05)
    return tr.stop()


def test_nonfinite_steps_in_a_row_stop_the_trainer_with_the_cause(tiny_model, tmp_path):
    ref = TorchBackend(tiny_model, lr=1e-3)
    dl = _DataLayer(_poisoned(_batch(ref.model, ref.tokenizer)))
    tr = Trainer(policy="p", cfg=TrainerConfig(lr=1e-3, max_nonfinite_steps=2), model_path=tiny_model,
                 weights_root=str(tmp_path / "weights"), keep_versions=10, data_layer=dl, max_steps=5,
                 optimizer_path=str(tmp_path / "opt.pt"))
    st = _run_until_stopped(tr)
    assert not st["done"]
    assert st["error"].startswith("NonFiniteError: trainer p: 2 steps in a row")
    assert "trainer.max_nonfinite_steps = 2" in st["error"] and "policies[p].trainer.lr" in st["error"]
    # the first skipped step was published (the same, finite weights) with its count
    assert st["version"] == 1 and st["last_metrics"]["nonfinite_skipped"] == 1.0
    assert st["last_metrics"]["nonfinite_in_a_row"] == 1.0
    store = WeightStore(str(tmp_path / "weights"))
    v0, v1 = store.load("p", 0), store.load("p", 1)
    assert all(torch.equal(v0[k], v1[k]) for k in v0)


def test_a_trainer_whose_weights_blew_up_publishes_nothing_and_saves_no_optimiser_state(tiny_model, tmp_path):
    ref = TorchBackend(tiny_model, lr=1e-3)
    dl = _DataLayer(_batch(ref.model, ref.tokenizer))
    tr = Trainer(policy="p", cfg=TrainerConfig(lr=1e-3), model_path=tiny_model,
                 weights_root=str(tmp_path / "weights"), keep_versions=10, data_layer=dl, max_steps=3,
                 optimizer_path=str(tmp_path / "opt.pt"))
    tr.start(run_loop=False)
    for g in tr.backend.optimizer.param_groups:  # what a far too high learning rate does
        g["lr"] = float("inf")
    with pytest.raises(NonFiniteError, match="not publishing v1"):
        tr.step()
    assert tr.committed == 0 and WeightStore(str(tmp_path / "weights")).versions("p") == [0]
    assert not tr.save_optimizer() and not (tmp_path / "opt.pt").exists()


def test_a_learning_rate_that_is_not_finite_is_a_config_error():
    with pytest.raises(ValueError, match="finite"):
        TrainerConfig(lr=float("inf"))
    assert TrainerConfig().max_nonfinite_steps >= 1
