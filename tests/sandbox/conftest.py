"""The sandbox tests need a working bubblewrap: without one they skip, with the reason, unless
``ASTRAFLOW_REQUIRE_SANDBOX=1`` (tests/run.sh sets it after installing bubblewrap), when they
fail instead so CI cannot pass by skipping them."""

from __future__ import annotations

import os
import time

import pytest

from astraflow.sandbox import Sandbox, SandboxConfig, SandboxUnavailable


def _why_unavailable() -> str | None:
    try:
        Sandbox(SandboxConfig()).check()
    except SandboxUnavailable as err:
        return str(err)
    return None


WHY = _why_unavailable()


@pytest.fixture(autouse=True)
def _needs_bubblewrap():
    if WHY is not None:
        if os.environ.get("ASTRAFLOW_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"ASTRAFLOW_REQUIRE_SANDBOX=1 but the sandbox is unavailable: {WHY}", pytrace=False)
        pytest.skip(WHY)


def sandbox_processes(token: str, parent: int | None = None) -> list[int]:
    """Host pids of live (not zombie) processes whose command line contains ``token``; with
    ``parent``, only those descending from it (executions this process started, not those of a
    test running beside it)."""
    found, parents = [], {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                state, ppid = f.read().rsplit(b")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        parents[int(entry)] = int(ppid)
        if token.encode() in cmdline and state != b"Z":
            found.append(int(entry))
    if parent is None:
        return found

    def descends(pid: int) -> bool:
        seen = set()
        while pid in parents and pid not in seen:
            seen.add(pid)
            pid = parents[pid]
            if pid == parent:
                return True
        return False

    return [pid for pid in found if descends(pid)]


def none_left(token: str, within_s: float = 10.0) -> bool:
    """Whether every process of a finished execution is gone within ``within_s``: the kernel
    kills a PID namespace's processes with its init, but a busy machine takes a moment to."""
    deadline = time.monotonic() + within_s
    while sandbox_processes(token):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
