"""Writes refused for want of room: a full disk, an exceeded quota (EDQUOT, which ``df`` does not
show on Lustre, GPFS or NFS) and a file-size limit (EFBIG, ``ulimit -f``). Each is found however
it is wrapped, keeps its errno, names the file whose filesystem refused it, and ends a run with
its own line: a quota is not a full disk to move away from, a file-size limit not a disk at all."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from astraflow.runtime.stopping import disk_full, disk_full_reason
from storage import holds
from storage.atomic import write_atomically
from storage.full_disk import full_disk_in
from storage.trajectories import open_trajectory_store
from storage.weights import WeightStore
from storage_workers import make_row

ROOT = Path(__file__).resolve().parents[2]


def _zip_writer_error(code: int) -> CheckpointException:
    """What ``dcp.save`` raises when a write is refused: torch's zip writer words it as its own
    ``RuntimeError``, the ``OSError`` only in its context, inside the rank's failure."""
    try:
        try:
            raise OSError(code, os.strerror(code))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as err:
        return CheckpointException("save failed", {0: _wrap_exception(err)})


@pytest.mark.parametrize("code", [errno.EDQUOT, errno.EFBIG, errno.ENOSPC])
def test_a_publish_refused_for_room_raises_its_errno_though_the_disk_shows_room(tmp_path, monkeypatch, code):
    """The errno inside the zip writer's error is the publish's, not a guess from the free space."""
    import shutil

    def refused(state_dict, storage_writer, no_dist):
        raise _zip_writer_error(code)

    monkeypatch.setattr(dcp, "save", refused)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: namedtuple("u", "total used free")(2**40, 0, 2**40))
    store = WeightStore(tmp_path / "w")
    with pytest.raises(OSError) as info:
        store.publish("p", 1, {"w": torch.zeros(4)})
    assert info.value.errno == code and disk_full(info.value)
    assert "publishing p v1 failed" in str(info.value) and "staging" in info.value.filename
    assert full_disk_in(_zip_writer_error(code)).errno == code
    assert full_disk_in(_zip_writer_error(errno.EIO)) is None


def test_the_megatron_ranks_look_for_a_full_disk_with_the_same_helper():
    from astraflow.training.megatron import rank

    assert rank.full_disk_in is full_disk_in


def test_a_publish_past_the_file_size_limit_ends_with_the_ulimit_line(tmp_path):
    """A real RLIMIT_FSIZE (SIGXFSZ ignored, as Python does): the publish raises EFBIG and the
    run's line names ``ulimit -f``, not a full disk."""
    script = (
        "import resource, signal, sys, torch\n"
        "from storage.weights import WeightStore\n"
        "from astraflow.runtime.stopping import disk_full, disk_full_reason\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.RLIM_INFINITY))\n"
        "try:\n"
        "    WeightStore(sys.argv[1]).publish('p', 1, {'w': torch.zeros(1 << 20)})\n"
        "except OSError as err:\n"
        "    print(err.errno, disk_full(err), disk_full_reason(err, sys.argv[1]), sep='|')\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run")], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    code, full, reason = out.stdout.strip().split("|")
    assert int(code) == errno.EFBIG and full == "True", out.stdout
    assert reason.startswith(f"file-size limit reached on {tmp_path / 'run'}") and "`ulimit -f`" in reason


def test_a_quota_and_a_file_size_limit_each_end_the_run_with_their_own_line(tmp_path):
    inside = str(tmp_path / "weights" / "v1.bin")
    quota = disk_full_reason(OSError(errno.EDQUOT, "Disk quota exceeded", inside), tmp_path)
    assert quota.startswith(f"quota exceeded on {tmp_path} (writing {inside} failed): check your quota")
    assert "quota -s" in quota and "lfs quota" in quota and "move the run directory" not in quota
    assert f"`astraflow run` again on this directory to resume" in quota
    store = OSError(errno.EDQUOT, "Disk quota exceeded", "/lustre/traj/seg/c0")  # a filesystem of its own
    assert disk_full_reason(store, tmp_path).startswith("quota exceeded on /lustre/traj/seg/c0 ")
    assert f"again on {tmp_path} to resume" in disk_full_reason(store, tmp_path)
    big = disk_full_reason(OSError(errno.EFBIG, "File too large", inside), tmp_path)
    assert big.startswith(f"file-size limit reached on {tmp_path}") and "RLIMIT_FSIZE" in big and "Slurm" in big
    assert disk_full(OSError(errno.EFBIG, "File too large")) and not disk_full(OSError(errno.EIO, "I/O error"))


def test_a_failed_atomic_write_names_the_file(tmp_path, monkeypatch):
    """A file object's write and ``fsync`` name no file: the error names the one being written."""
    def quota(fd):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(os, "fsync", quota)
    final = tmp_path / "elsewhere" / "state.json"
    final.parent.mkdir()
    with pytest.raises(OSError) as info:
        write_atomically(final, b"{}")
    assert info.value.errno == errno.EDQUOT and info.value.filename == str(final)
    assert isinstance(info.value.__cause__, OSError) and list(final.parent.iterdir()) == []


@pytest.mark.parametrize("where", ["/data/c/", "/commits/"])
def test_a_trajectory_store_that_fills_is_named_not_the_run_directory(tmp_path, monkeypatch, where):
    """``os.pwrite`` names no file: a store on a filesystem of its own that fills (chunk data or
    its commit log) is named in the error, so the run's line names that filesystem."""
    root = tmp_path / "store"
    store = open_trajectory_store(str(root))
    real = os.pwrite

    def pwrite(fd, data, offset):
        if where in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(OSError) as info:
        with store.writer("seg", batch_size=2) as w:
            w.write([make_row(0, i) for i in range(4)])
    err = info.value if info.value.errno is not None else full_disk_in(info.value)
    assert err.errno == errno.ENOSPC and Path(err.filename).is_relative_to(root), err.filename
    run_dir = tmp_path / "run"
    assert disk_full_reason(err, run_dir).startswith(f"no space left on the filesystem of {err.filename}")


@pytest.mark.parametrize("code, says", [(errno.EDQUOT, "quota is exceeded"), (errno.ENOSPC, "disk is full"),
                                        (errno.EACCES, "give this process write access")])
def test_a_hold_file_refused_for_room_says_so_not_write_access(tmp_path, monkeypatch, code, says):
    def refused(final, data):
        raise OSError(code, os.strerror(code), str(final))

    monkeypatch.setattr(holds, "write_atomically", refused)
    with pytest.raises(OSError) as info:
        holds.take(tmp_path, "p", 1, "host")
    assert info.value.errno == code and says in str(info.value)
    assert (code == errno.EACCES) == ("write access" in str(info.value))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
def test_each_full_disk_line_is_known_as_one(tmp_path, code):
    """The orchestrator does not repeat a full-disk reason when the summary then cannot be
    written either: each kind of line is recognised."""
    from astraflow.runtime.stopping import disk_full_reason, is_disk_full_reason

    line = disk_full_reason(OSError(code, os.strerror(code), str(tmp_path / "x")), tmp_path)
    assert is_disk_full_reason(line) and not is_disk_full_reason("trainer solver failed: KeyError: 'x'")


def test_a_read_only_filesystem_ends_the_run_with_its_own_line(tmp_path):
    """A filesystem made read-only (remounted, or by the kernel after an I/O error) ends the run as
    a full disk does (a new worker would meet it too), with a line that says so, not 'no space'."""
    inside = str(tmp_path / "control" / "status.json")
    err = OSError(errno.EROFS, "Read-only file system", inside)
    assert disk_full(err)
    line = disk_full_reason(err, tmp_path)
    assert line.startswith(f"read-only filesystem at {tmp_path} (writing {inside} failed): make it writable again")
    assert "no space" not in line and "`astraflow run` again on this directory to resume" in line
    assert not disk_full(OSError(errno.EACCES, "Permission denied", inside))
