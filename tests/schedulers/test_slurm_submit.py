"""A partial ``sbatch`` failure: `SlurmScheduler.submit` is all or none. ``sbatch`` and
``scancel`` are small executables on PATH (the process boundary to Slurm) that record their
calls: the third ``sbatch`` fails, and the two jobs submitted before it must be cancelled by id."""

from __future__ import annotations

from pathlib import Path

import pytest

from schedulers import Partition, worker_name
from schedulers.slurm import PartialSubmitError, SlurmCommandError, SlurmScheduler

from tests.schedulers.fake_slurm import fake_slurm


def _sched(tmp_path: Path) -> SlurmScheduler:
    return SlurmScheduler(job_dir=tmp_path / "jobs", python="/usr/bin/python3", host="127.0.0.1", tag="t")


PART = Partition(name="gpu", scheduler="slurm", nodes=4, role="rollout")


def test_a_failing_third_sbatch_cancels_the_two_jobs_already_submitted(tmp_path, monkeypatch):
    rec = fake_slurm(tmp_path, monkeypatch)
    sched = _sched(tmp_path)
    with pytest.raises(PartialSubmitError) as info:
        sched.submit(PART, "tcp://127.0.0.1:8786", 4)
    err = info.value
    assert (rec / "calls").read_text().split() == ["3"]  # stopped at the failure
    assert (rec / "scancel.log").read_text().split() == ["4101", "4102"]
    assert err.cancelled == ["4101", "4102"] and err.returncode == 1
    assert isinstance(err, SlurmCommandError)  # the reconciler marks the partition failed with it
    message = str(err)
    assert "Requested node configuration is not available" in message
    assert "cancelled the 2 job(s) it had already submitted (4101, 4102)" in message
    assert "\n" not in message.strip()
    assert not sched._submitted  # nothing of the request is tracked as live


def test_when_cancelling_fails_too_the_error_names_the_jobs_to_cancel(tmp_path, monkeypatch):
    rec = fake_slurm(tmp_path, monkeypatch, scancel_rc=1)
    with pytest.raises(PartialSubmitError, match=r"failed too: .*scancel 4101 4102"):
        _sched(tmp_path).submit(PART, "tcp://127.0.0.1:8786", 4)
    assert (rec / "scancel.log").read_text().split() == ["4101", "4102"]


def test_a_first_sbatch_that_fails_raises_its_own_error_and_cancels_nothing(tmp_path, monkeypatch):
    rec = fake_slurm(tmp_path, monkeypatch, fail_at=1)
    with pytest.raises(SlurmCommandError) as info:
        _sched(tmp_path).submit(PART, "tcp://127.0.0.1:8786", 4)
    assert not isinstance(info.value, PartialSubmitError)
    assert not (rec / "scancel.log").exists()


def test_all_submitted_when_none_fails(tmp_path, monkeypatch):
    fake_slurm(tmp_path, monkeypatch, fail_at=99)
    refs = _sched(tmp_path).submit(PART, "tcp://127.0.0.1:8786", 4)
    assert [r.job_id for r in refs] == ["4101", "4102", "4103", "4104"]
    assert [r.worker_name for r in refs] == [worker_name(PART, i) for i in range(4)]


def test_an_os_error_part_way_cancels_the_jobs_already_submitted_too(tmp_path, monkeypatch):
    """Not sbatch failing but writing the next worker's script (a full disk, here a directory
    in its way): the jobs already submitted are cancelled and forgotten all the same."""
    rec = fake_slurm(tmp_path, monkeypatch, fail_at=99)
    sched = _sched(tmp_path)
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / f"{worker_name(PART, 2)}.sbatch").mkdir()
    with pytest.raises(OSError) as info:
        sched.submit(PART, "tcp://127.0.0.1:8786", 4)
    assert (rec / "scancel.log").read_text().split() == ["4101", "4102"]
    assert "cancelled the 2 job(s) it had already submitted (4101, 4102)" in " ".join(info.value.__notes__)
    assert not sched._submitted
