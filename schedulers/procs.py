"""Child processes that cannot outlive the process that started them.

A local Dask scheduler or worker started by an orchestrator that then dies (SIGKILL, a test
killed by its timeout, an OOM kill) would otherwise keep running with nobody to stop it. On
Linux the kernel can deliver a signal to a child when its parent dies (``PR_SET_PDEATHSIG``);
``die_with_parent`` asks for SIGKILL: with its orchestrator gone there is nothing left for a
worker to flush (its leases are the data layer's, which died too), and a worker seen hanging in
shutdown after losing its scheduler ignored SIGTERM for an hour. Elsewhere it does nothing.

A process that must be found again by a later run (a worker of a previous incarnation of a run)
is named by its pid *and* its `process_identity`: pids are reused, the identity is not.
"""

from __future__ import annotations

import ctypes
import signal
import socket
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for ``subprocess.Popen``: SIGKILL this child when its parent thread exits."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def process_identity(pid: int) -> str | None:
    """``<host>/<boot id>/<start time>`` of the running process `pid`, or None when there is
    none (or it is a zombie, or this is not Linux). Two readings are equal only for the same
    process: a pid the kernel gave to another process since has another start time, and after
    a reboot the boot id differs. A worker's identity is recorded when it starts, so a later
    run can tell whether a recorded pid is still that worker before it signals it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the command name in parentheses may contain blanks
    if fields[0] == "Z":
        return None
    return f"{socket.gethostname()}/{boot}/{fields[19]}"  # field 22 of stat(5): start time in clock ticks


def process_argv(pid: int) -> list[str]:
    """The command line of process `pid` (empty when it is gone or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]]
