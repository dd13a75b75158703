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


def sandbox_processes(token: str) -> list[int]:
    """Host pids of live (not zombie) processes whose command line contains ``token``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if token.encode() in cmdline and state != b"Z":
            found.append(int(entry))
    return found


def none_left(token: str, within_s: float = 10.0) -> bool:
    """Whether every process of a finished execution is gone within ``within_s``: the kernel
    kills a PID namespace's processes with its init, but a busy machine takes a moment to."""
    deadline = time.monotonic() + within_s
    while sandbox_processes(token):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
