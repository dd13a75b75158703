"""The scratch root and the execution directories: this user's own, refused when another user
could read or replace what is under them, and SandboxUnavailable naming the setting when they
cannot be made."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from astraflow.sandbox import Sandbox, SandboxConfig, SandboxUnavailable

LIMITS = dict(timeout_s=3.0, cpu_s=2.0, memory_mb=256, max_processes=16, max_output_bytes=4096)
OTHER_UID = 1234  # "another user" where this runs as root


@pytest.fixture
def shared_tmp():
    """A sticky, world-writable temp dir like /tmp, under /tmp (the sandbox's uid can pass through it)."""
    path = Path(tempfile.mkdtemp(prefix="astraflow-shared-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_default_scratch_root_is_this_users_own(shared_tmp, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    r = Sandbox(SandboxConfig(**LIMITS)).run("print(1)\n")
    assert r.status == "ok", r.stderr
    st = os.lstat(shared_tmp / f"astraflow-sandbox-{os.geteuid()}")
    assert st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _writable_by_others(where: Path) -> Path:
    where.mkdir()
    where.chmod(0o777)
    return where


def _a_symlink(where: Path) -> Path:
    target = where.with_name("elsewhere")
    target.mkdir(mode=0o711)
    where.symlink_to(target)
    return where


def _another_users(where: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("only root can make a directory of another user's")
    where.mkdir(mode=0o711)
    os.chown(where, OTHER_UID, OTHER_UID)
    return where


@pytest.mark.parametrize("make, why", [(_writable_by_others, "is writable by group or others"),
                                       (_a_symlink, "is not a directory"),
                                       (_another_users, f"belongs to uid {OTHER_UID}")])
@pytest.mark.parametrize("configured", [True, False])
def test_a_scratch_root_someone_else_could_change_is_refused(shared_tmp, monkeypatch, make, why, configured):
    """Another user who made the scratch root first could read the tests under it and swap an
    execution's inputs for a runner that reports a pass: refused, naming the fix."""
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    root = make(shared_tmp / ("mine" if configured else f"astraflow-sandbox-{os.geteuid()}"))
    cfg = SandboxConfig(**LIMITS, scratch_root=str(root) if configured else None)
    with pytest.raises(SandboxUnavailable, match=f"scratch root {root} {why}.*sandbox.scratch_root"):
        Sandbox(cfg).run("print(1)\n")


def test_a_second_user_gets_a_scratch_root_of_their_own(shared_tmp, monkeypatch):
    """Two users of one machine: the second one's executions work beside the first one's."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as another user")
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    assert Sandbox(SandboxConfig(**LIMITS)).run("print(1)\n").status == "ok"  # the first user's
    code = ("import tempfile\ntempfile.tempdir = %r\nfrom astraflow.sandbox import Sandbox\n"
            "print('status', Sandbox().run('print(1)').status)\n" % str(shared_tmp))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(shared_tmp),
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    user = [f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups"]
    proc = subprocess.run(["setpriv", *user, sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60, cwd=str(shared_tmp))
    assert "status ok" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert os.lstat(shared_tmp / f"astraflow-sandbox-{OTHER_UID}").st_uid == OTHER_UID


def test_execution_inputs_are_not_readable_by_other_users(tmp_path):
    sb = Sandbox(SandboxConfig(**LIMITS))
    sb.check()
    path = Path(sb._input_dir("print(1)\n", "def test_a():\n    pass\n"))
    try:
        drop_gid = SandboxConfig().sandbox_uid if os.geteuid() == 0 else None  # the sandbox's group reads them
        for p in (path, *path.iterdir()):
            st = os.lstat(p)
            assert st.st_uid == os.geteuid() and not st.st_mode & 0o027, (p, oct(st.st_mode))
            assert st.st_gid == drop_gid if drop_gid is not None else not st.st_mode & 0o070, (p, oct(st.st_mode))
    finally:
        shutil.rmtree(path)


@pytest.mark.parametrize("below", ["a-file/sub", "a-file"])
def test_a_scratch_root_that_cannot_be_made_names_the_setting(tmp_path, below):
    (tmp_path / "a-file").write_text("not a directory")
    root = tmp_path / below
    with pytest.raises(SandboxUnavailable, match=f"scratch root {root} .*set sandbox.scratch_root"):
        Sandbox(SandboxConfig(**LIMITS, scratch_root=str(root))).check()


def test_astraflow_check_reports_an_unusable_scratch_root_as_a_config_error(tmp_path, monkeypatch):
    """``astraflow check`` and ``run`` turn it into one line (a ValueError), not a traceback."""
    from astraflow.runtime import launch

    (tmp_path / "a-file").write_text("not a directory")
    monkeypatch.setattr(launch, "make_workload", lambda *a: SimpleNamespace(uses_sandbox=True))
    cfg = SimpleNamespace(workload=SimpleNamespace(name="code", params={}, seed=0),
                          sandbox=SandboxConfig(**LIMITS, scratch_root=str(tmp_path / "a-file" / "sub")))
    with pytest.raises(ValueError, match="sandbox: cannot create the sandbox's scratch root .*sandbox.scratch_root"):
        launch.check_sandbox(cfg)


def test_as_root_bubblewrap_starts_through_setpriv_where_installed(monkeypatch):
    """Popen asked to change the user copies the whole calling process; ``setpriv`` lets it
    start bubblewrap without that, as the same unprivileged user."""
    from astraflow.sandbox import bwrap

    cfg = SandboxConfig(sandbox_uid=4321)
    monkeypatch.setattr(bwrap.os, "geteuid", lambda: 0)
    monkeypatch.setattr(bwrap.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert bwrap.launcher(cfg) == (["/usr/bin/setpriv", "--reuid=4321", "--regid=4321", "--clear-groups", "--"], {})
    monkeypatch.setattr(bwrap.shutil, "which", lambda name: None)
    assert bwrap.launcher(cfg) == ([], {"user": 4321, "group": 4321, "extra_groups": []})
    monkeypatch.setattr(bwrap.os, "geteuid", lambda: 1000)
    assert bwrap.launcher(cfg) == ([], {}) and bwrap.sandbox_id(cfg) is None


def test_the_sandboxs_etc_is_one_staged_copy_shared_by_sandboxes(shared_tmp):
    """The few /etc files the interpreter reads are copied once under the scratch root and bound
    as /etc in one mount: the same names and contents as the host's, read-only, and a second
    sandbox with the same root reuses the copy."""
    from astraflow.sandbox import bwrap

    root = shared_tmp / "root"
    cfg = SandboxConfig(**LIMITS, scratch_root=str(root))
    program = ("import os\nprint(sorted(os.listdir('/etc')))\nprint(open('/etc/ld.so.conf').read(), end='')\n"
               "try:\n    open('/etc/x', 'w')\nexcept OSError as e:\n    print(type(e).__name__)\n")
    first = Sandbox(cfg)
    r = first.run(program)
    assert r.status == "ok", r.stderr
    names = sorted(Path(f).name for f in bwrap.ETC_FILES if os.path.lexists(f))
    assert r.stdout.splitlines()[0] == str(names)
    assert Path("/etc/ld.so.conf").read_text() in r.stdout and r.stdout.rstrip().endswith("OSError")
    second = Sandbox(cfg)
    assert second.run("print(1)\n").status == "ok"
    assert first._etc == second._etc and [p.name for p in root.iterdir() if p.name.startswith("etc-")] == [
        Path(first._etc).name]
    assert not any(p.name.startswith(".etc-") for p in root.iterdir())  # no half-made copy left


def test_a_staged_etc_pruned_or_removed_is_made_again(shared_tmp):
    """A /tmp cleaner may prune the staged copy (a later sandbox then replaces it) or remove it
    while a sandbox uses it (its next execution stages it again)."""
    root = shared_tmp / "root"
    cfg = SandboxConfig(**LIMITS, scratch_root=str(root))
    first = Sandbox(cfg)
    assert first.run("print(1)\n").status == "ok"
    staged = Path(first._etc)
    (staged / "ld.so.conf").unlink()
    second = Sandbox(cfg)
    r = second.run("print(open('/etc/ld.so.conf').read(), end='')\n")
    assert r.status == "ok" and r.stdout == Path("/etc/ld.so.conf").read_text(), r.stderr
    assert second._etc == str(staged) and (staged / "ld.so.conf").exists()
    shutil.rmtree(staged)
    r = first.run("print(open('/etc/ld.so.conf').read(), end='')\n")
    assert r.status == "ok" and r.stdout == Path("/etc/ld.so.conf").read_text(), r.stderr


def test_a_scratch_root_others_could_swap_from_above_is_refused(shared_tmp):
    """A root of this user's own that only they can write, inside a directory that others can write without the
    sticky bit: they could rename it away and put theirs in its place after the check, and the
    next execution's tests and runner would go into their directory."""
    above = _writable_by_others(shared_tmp / "project")
    root = above / "root"
    root.mkdir(mode=0o711)  # the sandbox's uid may pass (where the node is root)
    with pytest.raises(SandboxUnavailable, match=f"scratch root {root} is inside {above}, which group/others can "
                                                 r"write without the sticky bit.*set sandbox.scratch_root"):
        Sandbox(SandboxConfig(**LIMITS, scratch_root=str(root))).check()


def test_missing_directories_above_a_scratch_root_are_not_writable_by_others(shared_tmp):
    """Made under a umask of 000, the directories above a new scratch root must not let others
    rename it away."""
    root = shared_tmp / "a" / "b" / "root"
    old = os.umask(0)
    try:
        r = Sandbox(SandboxConfig(**LIMITS, scratch_root=str(root))).run("print(1)\n")
    finally:
        os.umask(old)
    assert r.status == "ok", r.stderr
    for d in (shared_tmp / "a", shared_tmp / "a" / "b"):
        assert not d.stat().st_mode & 0o022, (d, oct(d.stat().st_mode))
