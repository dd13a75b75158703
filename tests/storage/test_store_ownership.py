"""A trajectory store outside the run directory (``storage.trajectories``) is held to the run
directory's rule, as the run trains from what is in it: a directory (and its ``segments/``) of
the user's own that only the user can write, reached through no symlink of another user and no
directory others can rename entries in. A writer refuses any other (``open_backend`` with
``mode="a"``), and so do `astraflow check` and `run` (new or resumed): exit 2, one line naming
the path and the fix. Giving a file to another user needs root: that case runs as root only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from storage.ownership import UnsafeDir
from storage.trajectories.backends import open_backend
from storage.trajectories.locations import check_store_url
from tests.e2e.test_cli import _write_config

ROOT = Path(__file__).resolve().parents[2]
OTHER_UID = 65534


def _forms(path: Path) -> list[str]:
    """The URLs that name directory ``path``: itself, and ``file://``."""
    return [str(path), path.as_uri()]


@pytest.mark.parametrize("where", ["", "segments"])
def test_a_store_others_can_write_is_refused_in_both_url_forms(tmp_path, where):
    store = tmp_path / "store"
    bad = store / where if where else store
    bad.mkdir(parents=True)
    bad.chmod(0o777)
    for url in _forms(store):
        with pytest.raises(UnsafeDir, match=f"^trajectory store .*{bad} is writable by group/others .*"
                                            f"chmod go-w {bad}' or point storage.trajectories at another directory$"):
            open_backend(url, "a", durable=False)
        with pytest.raises(UnsafeDir):
            check_store_url(url)
    assert open_backend(str(store), "r", durable=False).root == store  # reading is another matter


def test_a_store_inside_a_directory_others_can_rename_entries_in_is_refused_before_it_is_made(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    for url in _forms(shared / "store"):
        with pytest.raises(UnsafeDir, match=f"is inside {shared}, which group/others can write without the sticky"):
            open_backend(url, "a", durable=False)
    assert not (shared / "store").exists()


def test_a_new_store_and_its_parents_are_made_unwritable_by_others_whatever_the_umask(tmp_path):
    old = os.umask(0o002)
    try:
        backend = open_backend((tmp_path / "a" / "store").as_uri(), "a", durable=False)
    finally:
        os.umask(old)
    assert backend.root == tmp_path / "a" / "store"
    for d in (tmp_path / "a", tmp_path / "a" / "store"):
        assert os.stat(d).st_mode & 0o022 == 0
    check_store_url(str(tmp_path / "a" / "store"))
    check_store_url("memory://anything")  # in-process: nothing on disk to check


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_store_of_another_user_is_refused(tmp_path):
    (tmp_path / "store").mkdir(mode=0o755)
    os.chown(tmp_path / "store", OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeDir, match=f"{tmp_path / 'store'} is owned by uid {OTHER_UID}"):
        open_backend(str(tmp_path / "store"), "a", durable=False)
    shared = tmp_path / "shared"  # as /tmp: its entries' owners may replace them
    shared.mkdir()
    shared.chmod(0o1777)
    (shared / "link").symlink_to(tmp_path / "store")
    os.lchown(shared / "link", OTHER_UID, OTHER_UID)
    os.chown(tmp_path / "store", 0, 0)
    with pytest.raises(UnsafeDir, match=f"{shared / 'link'} is a symlink owned by uid {OTHER_UID}"):
        check_store_url((shared / "link").as_uri())


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", ["check", "run"])
def test_check_and_run_refuse_a_store_others_can_write_in_one_line(tiny_model, tmp_path, command):
    store = tmp_path / "store"
    store.mkdir()
    store.chmod(0o777)
    cfg = _write_config(tmp_path, tiny_model, run={"max_steps": 1}, storage={"trajectories": store.as_uri()})
    args = ["--run-dir", str(tmp_path / "run"), "--quiet"] if command == "run" else []
    proc = subprocess.run([sys.executable, "-m", "astraflow", command, str(cfg), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert errors == [f"Error: trajectory store {store} is writable by group/others (mode 0777): run 'chmod go-w "
                      f"{store}' or point storage.trajectories at another directory"], proc.stderr
    assert not any(store.iterdir()) and not (tmp_path / "run").exists()
