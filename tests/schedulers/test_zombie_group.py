"""Cancelling a local worker waits for its process group to end (`schedulers.local._end_group`),
but a group whose remaining members are all zombies has ended: nothing in it runs, and an
orphan's zombie waits for PID 1 to reap it (in a container without an init, never)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from schedulers import local

#: how long _end_group may wait in these tests; a group of zombies must not take it
DEADLINE_S = 30.0


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _group_with(member_argv: list[str]) -> tuple[int, subprocess.Popen]:
    """A process group whose leader has exited and been reaped, holding one more process (this
    test's child, so that it stays a zombie once it exits: nobody but this test reaps it)."""
    leader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], process_group=0)
    member = subprocess.Popen(member_argv, process_group=leader.pid)
    leader.kill()
    leader.wait()
    return leader.pid, member


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
@pytest.mark.timeout(90)
def test_a_group_of_zombies_only_is_not_waited_for():
    pgid, member = _group_with(["true"])
    try:
        deadline = time.monotonic() + 10
        while _state(member.pid) not in ("Z", None):  # None: reaped after all (then nothing is left)
            assert time.monotonic() < deadline, _state(member.pid)
            time.sleep(0.02)
        t0 = time.monotonic()
        local._end_group(pgid, time.monotonic() + DEADLINE_S)
        assert time.monotonic() - t0 < DEADLINE_S / 3
    finally:
        member.wait()


@pytest.mark.timeout(60)
def test_a_live_member_is_still_waited_for_and_killed_at_the_deadline():
    pgid, member = _group_with([sys.executable, "-c", "import signal, time; "
                                "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
    try:
        local._end_group(pgid, time.monotonic() + 0.5)
        assert member.wait(timeout=10) == -9  # SIGKILL
    finally:
        member.kill()
        member.wait()


@pytest.mark.timeout(60)
def test_without_proc_a_group_counts_while_it_has_members(monkeypatch):
    """Where /proc cannot tell (another OS, another pid namespace's /proc), any member counts,
    a zombie too: the wait is bounded by the deadline as before."""
    pgid, member = _group_with(["true"])
    monkeypatch.setattr(local, "_live_members", lambda pgid: None)
    try:
        deadline = time.monotonic() + 10
        while _state(member.pid) not in ("Z", None):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert local._group_alive(pgid)
    finally:
        member.wait()
    assert not local._group_alive(pgid)
