"""A ``storage.trajectories`` that no run can use is refused by ``astraflow check`` (exit 2,
naming the key and the forms it takes), not when the run's data layer opens the store: a
scheme other than ``file://``, a ``file://`` URL naming a host or no absolute path, and a
directory that cannot be created."""

from __future__ import annotations

import os

import pytest

from tests.test_cli_errors import _config, _invoke


@pytest.mark.parametrize("url, why", [
    ("s3://bucket/x", "no store reads scheme 's3'; give a directory path or a file:///abs/path URL"),
    ("file://rel/x", "names host 'rel'"),
    ("file://otherhost/x", "names host 'otherhost'"),
    ("file://localhost", "names no absolute path: give a directory path or a file:///abs/path URL"),
    ("memory://x", "is a store inside one process"),
])
def test_a_store_url_no_run_can_use_is_refused(tmp_path, url, why):
    res = _invoke("check", str(_config(tmp_path)), "--set", f"storage.trajectories={url}")
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert "storage.trajectories: " in text and why in text, res.output


def test_a_store_directory_that_cannot_be_created_is_refused(tmp_path):
    (tmp_path / "afile").write_text("")
    res = _invoke("check", str(_config(tmp_path)), "--set", f"storage.trajectories={tmp_path}/afile/store")
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert f"storage.trajectories: trajectory store directory {tmp_path}/afile/store cannot be created" in text
    assert "give a directory path or a file:///abs/path URL that this user can create" in text


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no /proc here")
def test_a_store_on_a_special_file_system_is_refused():
    from storage.trajectories.locations import check_store_url

    with pytest.raises(OSError, match="trajectory store directory /proc/astraflow-store cannot be created: "
                                      "no directory can be created in /proc"):
        check_store_url("/proc/astraflow-store")


def test_a_store_that_can_be_created_checks_and_is_not_made(tmp_path):
    res = _invoke("check", str(_config(tmp_path)), "--set", f"storage.trajectories=file://{tmp_path}/new/store")
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "new").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".astraflow")]


def test_another_run_directorys_own_store_is_refused_by_run_and_its_own_is_not(tmp_path):
    """A run that keeps no trajectories deletes, when it resumes, the segments of its own store
    that it does not need: another run writing there would lose its rows."""
    other = tmp_path / "other-run"
    (other / "control").mkdir(parents=True)
    (other / "control" / "run.lock").write_text("{}")
    (other / "trajectories" / "segments").mkdir(parents=True)
    (tmp_path / "link").symlink_to(other / "trajectories")
    for url in (f"{other}/trajectories", f"file://{other}/trajectories/sub", str(tmp_path / "link")):
        res = _invoke("run", str(_config(tmp_path)), "--run-dir", str(tmp_path / "mine"), "--quiet",
                      "--set", f"storage.trajectories={url}")
        assert res.exit_code == 2, res.output
        text = " ".join(res.output.split())
        assert f"is the trajectory store of the run in {other}" in text and "outside any run directory" in text
    from storage.trajectories.locations import owning_run

    assert owning_run(f"{other}/trajectories") == other
    assert owning_run(str(tmp_path / "shared")) is None and owning_run(f"{other}/elsewhere") is None
    project = tmp_path / "project"  # a control/ directory that is no run's (no run.lock)
    (project / "control").mkdir(parents=True)
    assert owning_run(f"{project}/trajectories") is None
