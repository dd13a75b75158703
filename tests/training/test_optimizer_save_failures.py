"""A failed optimiser-state save is never silent: one refused for want of room (a full disk, a
quota, a file-size limit) stops the trainer the way a publish's full disk does; any other is
counted in ``state()``; and a resume whose checkpoint lags its weights says by how much."""

from __future__ import annotations

import errno
import logging

import pytest

import astraflow.training.optimizer_checkpoint as oc
from astraflow.runtime.stopping import disk_full_reason, full_disk_of
from astraflow.training.config import TrainerConfig
from astraflow.training.torch_backend import TorchBackend
from astraflow.training.trainer import Trainer
from tests.training.test_torch_backend import _batch
from tests.training.test_trainer_loop import _DataLayer


def _trainer(tmp_path, tiny_model, max_steps=6, every=2):
    ref = TorchBackend(tiny_model, lr=1e-3)
    return Trainer(policy="p", cfg=TrainerConfig(lr=1e-3, optimizer_checkpoint_every=every), model_path=tiny_model,
                   weights_root=str(tmp_path / "weights"), keep_versions=max_steps + 1,
                   data_layer=_DataLayer(_batch(ref.model, ref.tokenizer)), max_steps=max_steps,
                   optimizer_path=str(tmp_path / "trainer_state" / "p" / "optimizer.pt"))


def _refuse(monkeypatch, code):
    def write(final, data, durable=True):
        raise OSError(code, "refused", str(final))

    monkeypatch.setattr(oc, "write_atomically", write)


@pytest.mark.parametrize("code", [errno.EDQUOT, errno.ENOSPC, errno.EFBIG])
def test_a_save_refused_for_room_stops_the_trainer_as_a_full_disk(tmp_path, tiny_model, monkeypatch, code):
    tr = _trainer(tmp_path, tiny_model)
    tr.start(run_loop=False)
    _refuse(monkeypatch, code)
    tr._run()  # the loop, in this thread: the save after step 2 fails
    st = tr.state()
    assert not st["done"] and st["trained_version"] == 2 and st["version"] <= 2
    err = full_disk_of(st)
    assert err is not None and err.errno == code and err.filename.endswith("optimizer.pt.pending")
    assert "saving the optimiser state of v2 failed" in st["error"]
    assert not disk_full_reason(err, tmp_path).startswith("trainer")


def test_a_sync_trainer_reports_a_full_disk_at_its_last_save(tmp_path, tiny_model, monkeypatch):
    """The save as it stops is not raised out of ``stop()`` (the run is ending): it is its error."""
    tr = _trainer(tmp_path, tiny_model)
    tr.start(run_loop=False)
    tr.step()
    _refuse(monkeypatch, errno.EDQUOT)
    st = tr.stop()
    assert st["error_os"][0] == errno.EDQUOT and full_disk_of(st) is not None


def test_other_save_failures_are_counted_in_the_state(tmp_path, tiny_model, monkeypatch):
    tr = _trainer(tmp_path, tiny_model, max_steps=4)
    tr.start(run_loop=False)
    _refuse(monkeypatch, errno.EIO)
    tr._run()
    st = tr.state()
    assert st["done"] and st["error"] is None and st["version"] == 4
    assert st["optimizer_save_failures"] == 3  # after steps 2 and 4, and v4 again as the loop ends


def test_a_resume_from_an_older_optimiser_state_warns_with_the_gap(tmp_path, tiny_model, caplog):
    first = _trainer(tmp_path, tiny_model, every=2)
    first.start(run_loop=False)
    for _ in range(3):  # v2's state is saved, v3 only published: the trainer dies before its last save
        first.step()
    with caplog.at_level(logging.INFO, logger="astraflow.training"):
        resumed = _trainer(tmp_path, tiny_model, every=2)
        assert resumed.start(run_loop=False) == 3 and resumed.state()["optimizer_resumed_from"] == 2
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("optimiser state of v2, 1 step(s) older than the weights" in m for m in warned), warned
