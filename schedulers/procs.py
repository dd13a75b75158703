"""Child processes that cannot outlive the process that started them.

A local Dask scheduler or worker started by an orchestrator that then dies (SIGKILL, a test
killed by its timeout, an OOM kill) would otherwise keep running with nobody to stop it. On
Linux the kernel can deliver a signal to a child when its parent dies (``PR_SET_PDEATHSIG``);
``die_with_parent`` asks for SIGKILL: with its orchestrator gone there is nothing left for a
worker to flush (its leases are the data layer's, which died too), and a worker seen hanging in
shutdown after losing its scheduler ignored SIGTERM for an hour. Elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for ``subprocess.Popen``: SIGKILL this child when its parent thread exits."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
