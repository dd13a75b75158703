"""Child processes that cannot outlive the process that started them.

A local Dask scheduler or worker started by an orchestrator that then dies (SIGKILL, a test
killed by its timeout, an OOM kill) would otherwise keep running with nobody to stop it. On
Linux the kernel can deliver a signal to a child when its parent dies (``PR_SET_PDEATHSIG``);
``die_with_parent`` asks for SIGKILL: with its orchestrator gone there is nothing left for a
worker to flush (its leases are the data layer's, which died too), and a worker seen hanging in
shutdown after losing its scheduler ignored SIGTERM for an hour. Elsewhere it does nothing.

A process that must be found again by a later run (a worker of a previous incarnation of a run)
is named by its pid *and* its `process_identity`: pids are reused, the identity is not.

Inside a Slurm job (an ``astraflow run`` in a head job or an allocation), ``scancel`` sends
SIGTERM to every process of the job at once; the run's own Dask processes would then be gone
before it could stop them in order (flush the nodes, commit, close the ledger). So there the
processes it starts ignore SIGTERM (``IGNORE_TERM_ENV``, read by ``dask_main``) and are stopped
with SIGINT (`stop_signal`); elsewhere SIGTERM stops them as usual. What those processes start
in turn (engine processes, Megatron ranks) still ends on scancel's SIGTERM.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1
#: "1" for the Dask processes a run starts inside a Slurm job: they ignore SIGTERM and stop on SIGINT
IGNORE_TERM_ENV = "ASTRAFLOW_IGNORE_SIGTERM"


def stop_signal() -> signal.Signals:
    """How this process stops the Dask processes it started: SIGINT inside a Slurm job (module
    docstring), else SIGTERM."""
    return signal.SIGINT if os.environ.get("SLURM_JOB_ID") else signal.SIGTERM


def stop_env() -> dict[str, str]:
    """What the environment of a Dask process started here adds for `stop_signal`."""
    return {IGNORE_TERM_ENV: "1"} if stop_signal() == signal.SIGINT else {}


def die_with_parent() -> None:
    """``preexec_fn`` for ``subprocess.Popen``: SIGKILL this child when its parent thread exits."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def exit_code(code: object) -> int:
    """The process exit status ``SystemExit(code)`` stands for (a message is printed to stderr
    and counts as 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


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
