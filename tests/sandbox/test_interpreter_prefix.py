"""An interpreter outside the system directories: the sandbox sees it and its standard library,
never the rest of its installation prefix (a Python installed with ``--prefix=$HOME`` would
otherwise show the home directory, ``~/.ssh`` included); one it cannot reach is said so."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from astraflow.sandbox import Sandbox, SandboxConfig, SandboxUnavailable

LIMITS = dict(timeout_s=10.0, cpu_s=5.0, memory_mb=256, max_processes=16, max_output_bytes=4096)
SYSTEM_PYTHON = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")


@pytest.fixture
def home_prefix():
    """A home directory that is a Python prefix: ``bin/python3.X``, ``lib/python3.X`` (the
    system's standard library, linked) and a private key beside them. Under /var/tmp: the
    sandbox replaces /tmp with its own, and the sandbox's user must reach it."""
    if not SYSTEM_PYTHON.exists():
        pytest.skip(f"needs {SYSTEM_PYTHON} to copy")
    home = Path(tempfile.mkdtemp(prefix="astraflow-home-", dir="/var/tmp"))
    try:
        home.chmod(0o755)
        (home / "bin").mkdir()
        python = home / "bin" / SYSTEM_PYTHON.name
        shutil.copy2(SYSTEM_PYTHON, python)
        (home / "lib").mkdir()
        (home / "lib" / SYSTEM_PYTHON.name).symlink_to(f"/usr/lib/{SYSTEM_PYTHON.name}")
        (home / ".ssh").mkdir(mode=0o755)
        (home / ".ssh" / "id_rsa").write_text("PRIVATE KEY\n")
        (home / ".ssh" / "id_rsa").chmod(0o644)  # readable by any user: only the sandbox's walls keep it
        yield home, python
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_a_prefix_that_is_a_home_directory_shows_only_the_interpreter_and_its_library(home_prefix):
    home, python = home_prefix
    sb = Sandbox(SandboxConfig(**LIMITS, interpreter=str(python)))
    r = sb.run(f"import os, sys\nprint(sys.version_info[:2])\nprint(os.path.exists({str(home / '.ssh')!r}))\n"
               f"print(sorted(os.listdir({str(home)!r})))\n")
    assert r.status == "ok", r
    lines = r.stdout.splitlines()
    assert lines[1] == "False" and lines[2] == "['bin', 'lib']", r.stdout


@pytest.mark.parametrize("under, needle", [
    ("/var/tmp", r"no standard library under .*set sandbox.interpreter"),  # a bin/python3 alone
    ("/tmp", r"is under /tmp, which the sandbox replaces"),
])
def test_an_interpreter_the_sandbox_cannot_use_is_refused_naming_why(under, needle):
    where = Path(tempfile.mkdtemp(prefix="astraflow-python-", dir=under))
    try:
        (where / "bin").mkdir()
        shutil.copy2(SYSTEM_PYTHON if SYSTEM_PYTHON.exists() else sys.executable, where / "bin" / "python3")
        with pytest.raises(SandboxUnavailable, match=needle):
            Sandbox(SandboxConfig(**LIMITS, interpreter=str(where / "bin" / "python3"))).check()
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_an_interpreter_the_sandboxs_user_cannot_reach_names_the_setting_not_user_namespaces():
    private = Path(tempfile.mkdtemp(prefix="astraflow-private-", dir="/var/tmp"))
    try:
        if os.geteuid() != 0:
            pytest.skip("the sandbox drops privileges only when started as root")
        (private / "py" / "bin").mkdir(parents=True)
        (private / "py" / "lib").mkdir()
        (private / "py" / "lib" / SYSTEM_PYTHON.name).symlink_to(f"/usr/lib/{SYSTEM_PYTHON.name}")
        shutil.copy2(SYSTEM_PYTHON, private / "py" / "bin" / "python3")
        private.chmod(0o700)  # as /root is: the sandbox's user (nobody) cannot enter
        with pytest.raises(SandboxUnavailable) as err:
            Sandbox(SandboxConfig(**LIMITS, interpreter=str(private / "py" / "bin" / "python3"))).check()
        assert "cannot reach the sandbox interpreter" in str(err.value) and "sandbox.interpreter" in str(err.value)
        assert "user namespaces" not in str(err.value)
    finally:
        shutil.rmtree(private, ignore_errors=True)
