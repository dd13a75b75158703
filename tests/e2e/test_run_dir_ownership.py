"""A run directory belongs to its owner: the pieces that create it make it 0700 and write files
0600 under the owner-only umask; `astraflow run` and `astraflow partitions add/remove` refuse a
run directory (or a top-level subdirectory) that other users can write, or could swap for one of
theirs (a symlink of theirs, a directory above it they can rename entries in), in a subprocess as
a user meets it: exit 2, one line naming the path and the fix. `run.name` becomes a path
component, so a name that is not one plain word is refused by `astraflow check` and `run`.

Giving a file to another user needs root: those cases run as root only (CI may be either)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from astraflow.runtime.control import write_desired
from astraflow.runtime.monitoring import write_orchestrator_info, write_status
from astraflow.runtime.runlock import RunDirLock
from schedulers import Partition
from storage.atomic import write_json
from astraflow.cli import _default_run_dir
from storage import ownership
from storage.ownership import UnsafeRunDir, check_owner_only, make_owner_only, owner_only
from storage.paths import RunPaths, check_name
from tests.e2e.test_cli import _write_config

ROOT = Path(__file__).resolve().parents[2]
#: a user other than the one running the tests ("nobody" on most systems)
OTHER_UID = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "astraflow", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _one_error(proc: subprocess.CompletedProcess) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert len(errors) == 1 and errors[0].startswith("Error: "), proc.stderr
    return errors[0]


# -- created owner-only ------------------------------------------------------------------------

def test_a_new_run_directory_is_0700_even_under_a_permissive_umask(tmp_path):
    old = os.umask(0o002)
    try:
        with RunDirLock(tmp_path / "a" / "run"):
            pass
        assert _mode(tmp_path / "a" / "run") == 0o700
        assert _mode(RunPaths(tmp_path / "b").make().root) == 0o700
    finally:
        os.umask(old)


def test_under_owner_only_files_are_0600_and_directories_0700_and_the_umask_comes_back(tmp_path):
    before = os.umask(0o022)
    try:
        with owner_only():
            paths = RunPaths(make_owner_only(tmp_path / "run")).make()
            write_json(paths.summary, {"ok": True})
            with RunDirLock(paths.root):
                pass
        assert os.umask(0o022) == 0o022  # restored
    finally:
        os.umask(before)
    assert _mode(paths.root) == _mode(paths.control) == _mode(paths.logs) == 0o700
    assert _mode(paths.summary) == _mode(paths.run_lock) == 0o600


def test_an_existing_directory_that_only_its_owner_writes_is_accepted_and_left_as_it_is(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    run.chmod(0o755)
    make_owner_only(run)
    check_owner_only(tmp_path / "not-yet")  # created later, owner-only
    assert _mode(run) == 0o755


def _shared_group(path: Path) -> None:
    """Give ``path`` a group that is not the user's own private one, where its group write bit
    lets other users in (the user's private group is theirs alone: ``storage.ownership``)."""
    if os.geteuid() == 0:
        os.chown(path, -1, OTHER_UID)
    elif ownership._private_group(path.stat().st_gid) and not path.stat().st_mode & stat.S_IWOTH:
        pytest.skip("the group here is the user's private group: its write bit lets no one else in")


def test_a_private_group_may_write_what_is_only_the_users(tmp_path, monkeypatch):
    """A umask of 002 with a group of one's own (most RPM distributions): the group write bit
    of the run directory and the directories above it lets no one else in."""
    monkeypatch.setattr(ownership, "_private_group", lambda gid: True)
    (tmp_path / "clone").mkdir()
    (tmp_path / "clone").chmod(0o775)
    check_owner_only(tmp_path / "clone" / "runs" / "x")
    monkeypatch.setattr(ownership, "_private_group", lambda gid: False)
    with pytest.raises(UnsafeRunDir, match="which group/others can write without the sticky bit"):
        check_owner_only(tmp_path / "clone" / "runs" / "x")


@pytest.mark.parametrize("where, mode", [("", 0o775), ("", 0o777), ("", 0o1777), ("control", 0o770),
                                         ("weights", 0o757)])
def test_a_directory_others_can_write_is_refused_naming_the_path_and_the_fix(tmp_path, where, mode):
    run = tmp_path / "run"
    bad = run / where if where else run
    bad.mkdir(parents=True)
    bad.chmod(mode)
    _shared_group(bad)
    with pytest.raises(UnsafeRunDir) as err:
        check_owner_only(run)
    assert f"{bad} is writable by group/others (mode {mode:04o}): run 'chmod go-w {bad}'" in str(err.value)
    with pytest.raises(UnsafeRunDir):
        RunDirLock(run).acquire()
    assert not (run / "control" / "run.lock").exists()


def test_a_directory_of_another_user_or_a_file_is_refused(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    with pytest.raises(UnsafeRunDir, match="is not a directory"):
        check_owner_only(tmp_path / "file")
    (tmp_path / "run").mkdir(mode=0o700)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.raises(UnsafeRunDir, match=f"{tmp_path / 'run'} is owned by uid .* not by you .*choose a run directory"):
        check_owner_only(tmp_path / "run")


# -- how it is reached ---------------------------------------------------------------------------

def test_a_run_directory_inside_a_directory_others_can_rename_entries_in_is_refused(tmp_path):
    shared = tmp_path / "shared"
    (shared / "mine").mkdir(parents=True)
    (shared / "mine").chmod(0o700)
    shared.chmod(0o777)  # no sticky bit: anyone can rename what is in it, a directory of one's own too
    needle = (f"is inside {shared}, which group/others can write without the sticky bit (mode 0777), so they can "
              "rename or replace what is in it")
    for run in (shared / "run", shared / "mine" / "run"):
        with pytest.raises(UnsafeRunDir, match="^run directory .*" + re.escape(needle)):
            RunDirLock(run).acquire()
        assert not run.exists()  # refused before it was made
    shared.chmod(0o1777)  # the sticky bit, as /tmp has: only an entry's owner can rename it
    with RunDirLock(shared / "mine" / "run"):
        assert RunPaths(shared / "mine" / "run").run_lock.exists()


def test_a_symlink_of_ones_own_is_followed_and_its_target_checked(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with RunDirLock(tmp_path / "link"):
        assert (tmp_path / "real" / "control" / "run.lock").exists()
    (tmp_path / "real").chmod(0o777)
    with pytest.raises(UnsafeRunDir, match="is writable by group/others"):
        check_owner_only(tmp_path / "link")


@as_root
def test_a_symlink_of_another_user_is_refused_and_nothing_is_written_through_it(tmp_path):
    """In a sticky directory open to all (as /tmp) its owner may replace it; in a directory
    only we can write (a site's link in a root-owned one, say) nobody can: that one is followed."""
    (tmp_path / "target").mkdir(mode=0o700)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    (shared / "run").symlink_to(tmp_path / "target")
    os.lchown(shared / "run", OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeRunDir, match=f"^run directory {shared / 'run'} is a symlink owned by uid {OTHER_UID}"):
        RunDirLock(shared / "run").acquire()
    (shared / "via").symlink_to(tmp_path)
    os.lchown(shared / "via", OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeRunDir, match=f"goes through {shared / 'via'}, which is a symlink owned by uid"):
        RunDirLock(shared / "via" / "target").acquire()
    assert not any((tmp_path / "target").iterdir())
    (tmp_path / "site").symlink_to(tmp_path / "target")
    os.lchown(tmp_path / "site", OTHER_UID, OTHER_UID)
    RunDirLock(tmp_path / "site").acquire().release()
    assert (tmp_path / "target" / "control").is_dir()


@as_root
def test_a_run_directory_inside_a_directory_of_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    (theirs / "run").mkdir(parents=True, mode=0o700)  # ours, but they may rename it and put theirs there
    theirs.chmod(0o755)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    for run in (theirs / "run", theirs / "new"):
        with pytest.raises(UnsafeRunDir, match=f"is inside {theirs}, owned by uid {OTHER_UID}.*who can rename"):
            RunDirLock(run).acquire()
    assert not (theirs / "new").exists() and not any((theirs / "run").iterdir())


def test_the_default_runs_directory_is_refused_when_others_can_change_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir(mode=0o777)
    (tmp_path / "runs").chmod(0o777)  # made by someone else, or left open
    with pytest.raises(UnsafeRunDir, match=f"is inside {tmp_path / 'runs'}, which group/others can write"):
        _default_run_dir("tiny")
    assert not any((tmp_path / "runs").iterdir())
    if os.geteuid() == 0:
        (tmp_path / "runs").chmod(0o755)
        os.chown(tmp_path / "runs", OTHER_UID, OTHER_UID)
        with pytest.raises(UnsafeRunDir, match=f"is inside {tmp_path / 'runs'}, owned by uid {OTHER_UID}"):
            _default_run_dir("tiny")
    (tmp_path / "runs").rmdir()
    assert _default_run_dir("tiny").parent == Path("runs")  # made afresh, ours


def test_a_name_with_a_trailing_newline_is_not_a_plain_name():
    with pytest.raises(ValueError, match="not usable as a path component"):
        check_name("policy", "p\n")


# -- refused by the CLI --------------------------------------------------------------------------

def _live_run(root: Path) -> Path:
    """A run directory whose control files say "running" (this test process is the orchestrator)."""
    paths = RunPaths(root).make()
    parts = [Partition(name="data", role="data"), Partition(name="trainer", role="trainer"),
             Partition(name="rollout", role="rollout")]
    write_desired(paths, parts)
    write_orchestrator_info(paths, None, "tcp://127.0.0.1:1")
    write_status(paths, {"written_at": time.time(), "run_dir": str(paths.root), "data_layer": {}, "trainers": {},
                         "workers": {}, "partitions": {p.name: {**p.model_dump(mode="json"), "state": "active"}
                                                       for p in parts}})
    return paths.root


@pytest.mark.e2e
@pytest.mark.parametrize("mode", [0o775, 0o777])
def test_run_and_partitions_refuse_a_run_directory_others_can_write(tiny_model, tmp_path, mode):
    cfg, run = _write_config(tmp_path, tiny_model), _live_run(tmp_path / "run")
    desired = RunPaths(run).desired_partitions.read_bytes()
    run.chmod(mode)
    _shared_group(run)
    needle = f"run directory {run} is writable by group/others (mode {mode:04o}): run 'chmod go-w {run}'"
    for args in (["run", str(cfg), "--run-dir", str(run), "--quiet"],
                 ["partitions", "add", str(run), "extra", "--nodes", "1", "--wait", "0"],
                 ["partitions", "remove", str(run), "rollout"]):
        assert needle in _one_error(_cli(*args)), args
    assert RunPaths(run).desired_partitions.read_bytes() == desired  # nothing was changed
    assert not RunPaths(run).summary.exists()


@pytest.mark.e2e
def test_run_refuses_a_runs_directory_others_can_write_in_one_line(tiny_model, tmp_path):
    cfg = _write_config(tmp_path, tiny_model, run={"max_steps": 1})
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs").chmod(0o777)
    proc = subprocess.run([sys.executable, "-m", "astraflow", "run", str(cfg), "--quiet"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    error = _one_error(proc)
    assert f"is inside {tmp_path / 'runs'}, which group/others can write without the sticky bit" in error
    assert not any((tmp_path / "runs").iterdir())


BAD_NAMES = {"a space": "my run", "a newline": "my\nrun", "a percent sign": "run%j", "a slash": "../run",
             "65 characters": "r" * 65, "a leading dot": ".run"}


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(BAD_NAMES))
def test_check_refuses_a_run_name_that_is_not_a_plain_word(tiny_model, tmp_path, case):
    cfg = _write_config(tmp_path, tiny_model, run={"name": BAD_NAMES[case]})
    proc = _cli("check", str(cfg))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "run.name: " in proc.stderr and "cannot name a run: use 1-64 letters, digits" in proc.stderr


@pytest.mark.e2e
def test_run_refuses_a_bad_run_name_before_creating_anything(tiny_model, tmp_path):
    cfg = _write_config(tmp_path, tiny_model)
    proc = _cli("run", str(cfg), "--set", "run.name=my run", "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 2 and "run.name: 'my run' cannot name a run" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


# -- a whole run ---------------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_real_run_leaves_nothing_that_group_or_others_can_use(tiny_model, tmp_path):
    cfg, run = _write_config(tmp_path, tiny_model), tmp_path / "runs" / "run"
    proc = _cli("run", str(cfg), "--run-dir", str(run), "--set", "run.max_steps=1", "--quiet")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _mode(run) == 0o700
    loose = [f"{p} {_mode(p):04o}" for p in run.rglob("*") if not p.is_symlink() and _mode(p) & 0o077]
    assert not loose, loose
    assert (run / "summary.json").exists() and any((run / "weights").rglob("*"))


def test_a_dotdot_does_not_make_the_directory_left_count_as_above(tmp_path):
    """``open/../mine/run``: ``open`` (writable by others) is not above the run directory."""
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    (tmp_path / "mine").mkdir(mode=0o755)
    check_owner_only(tmp_path / "open" / ".." / "mine" / "run")
    with pytest.raises(UnsafeRunDir, match="which group/others can write without the sticky bit"):
        check_owner_only(tmp_path / "open" / "run")
