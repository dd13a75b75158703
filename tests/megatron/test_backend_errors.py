"""A rank that dies is reported with its log, and the other ranks are stopped (real processes)."""

from __future__ import annotations

import pytest
import torch

from astraflow.training.megatron.backend import MegatronBackend, MegatronBackendConfig
from astraflow.training.megatron.launch import RankError, RankKilled
from tests.megatron.helpers import save_tiny_llama


@pytest.mark.timeout(90)
@pytest.mark.parametrize("own_log_dir", [True, False])
def test_rank_failure_raises_rank_error_with_log_tail(tmp_path, monkeypatch, own_log_dir):
    """The error quotes the failed rank's log. The backend's work directory stays only when that
    log is in it (no ``log_dir``)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the backend makes its work directory
    hf = save_tiny_llama(tmp_path / "hf", tied=False)
    logs = tmp_path / "logs"
    with pytest.raises(RankError) as err:
        MegatronBackend(MegatronBackendConfig(
            hf_checkpoint=str(hf), tp_size=1 if torch.cuda.device_count() == 1 else 2,  # a rank per GPU
            loss_fn="no_such_module_xyz:grpo_loss",
            start_timeout_s=60, log_dir=str(logs) if own_log_dir else None,
        ))
    assert "no_such_module_xyz" in str(err.value) and "during 'init'" in str(err.value)
    # it failed on its own (a traceback, exit code 1): not a process lost to the OOM killer
    assert "ended with exit code 1" in str(err.value).splitlines()[0] and not isinstance(err.value, RankKilled)
    # the backend's work directories (not the rank fork server's, made here if it started in this test)
    workdirs = [d for d in tmp_path.glob("astraflow-megatron-*") if not d.name.startswith("astraflow-megatron-ranks-")]
    # every rank fails the same way: the error quotes the log of the one that exited first
    if own_log_dir:
        assert workdirs == [] and f"log ({logs / 'megatron-rank'}" in str(err.value)
    else:
        assert len(workdirs) == 1 and f"log ({workdirs[0] / 'megatron-rank'}" in str(err.value)


def test_parallel_sizes_are_checked(tmp_path):
    hf = save_tiny_llama(tmp_path / "hf", tied=False)
    with pytest.raises(ValueError, match=r"tp_size \(1\) and dp_size \(0\) must be 1 or more"):
        MegatronBackendConfig(hf_checkpoint=str(hf), dp_size=0)
    # every replica's share is normalised by the whole batch: the loss must take that count
    with pytest.raises(ValueError, match="dp_size=2 needs a loss_fn that takes num_tokens"):
        MegatronBackendConfig(hf_checkpoint=str(hf), dp_size=2, loss_fn="tests.megatron.helpers:grpo_loss_fallback")


def test_a_full_disk_is_found_inside_a_checkpoint_exception():
    """``dist_checkpointing.save`` raises torch's ``CheckpointException`` (a BaseException) on
    every rank, with each failed rank's error inside: the full disk is found there."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from astraflow.training.megatron.rank import full_disk_in

    try:
        raise OSError(errno.ENOSPC, "No space left on device", "/w/v3/__0_0.distcp")
    except OSError as e:
        wrapped = CheckpointException("save failed", {0: _wrap_exception(e)})
    found = full_disk_in(wrapped)
    assert found is not None and found.errno == errno.ENOSPC and found.filename == "/w/v3/__0_0.distcp"
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as e:
            raise RuntimeError("writing the shards failed") from e
    except RuntimeError as e:
        assert full_disk_in(e).errno == errno.EDQUOT
    assert full_disk_in(CheckpointException("x", {0: _wrap_exception(OSError(errno.EIO, "I/O error"))})) is None
    assert full_disk_in(ValueError("no")) is None


@pytest.mark.timeout(180)
def test_shards_written_to_a_full_disk_raise_its_oserror_and_the_ranks_go_on(tmp_path):
    """A publish onto a full filesystem (a real small tmpfs): the backend raises the ``OSError``
    (the run then stops as any full disk stops it), and its ranks still serve: the next save,
    with room, works."""
    import errno
    import subprocess

    from astraflow.runtime.stopping import disk_full

    small = tmp_path / "small"
    small.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k,mode=0700", "tmpfs", str(small)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {res.stderr.strip()}")
    try:
        hf = save_tiny_llama(tmp_path / "hf", tied=False)
        with MegatronBackend(MegatronBackendConfig(hf_checkpoint=str(hf), tp_size=1, start_timeout_s=120,
                                                   log_dir=str(tmp_path / "logs"))) as backend:
            with pytest.raises(OSError) as err:
                backend.save_shards(small / "v1")
            assert disk_full(err.value) and err.value.errno == errno.ENOSPC, err.value
            assert backend.save_shards(tmp_path / "v1")["save_s"] >= 0
            assert any((tmp_path / "v1").iterdir())
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)
