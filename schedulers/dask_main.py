"""The entry point of the Dask processes AstraFlow starts: ``dask worker`` or ``dask scheduler``
(``distributed.cli``), then a quick exit.

When the process has closed (told to, or on SIGTERM), the interpreter's own shutdown would
still tear down every module it imported; with torch and transformers loaded by the actors
that takes a second or more per process, which every run's teardown and every cancelled job
waits for. Here the exit handlers run as usual (logging flushed, child processes reaped,
finalizers), then the process ends at once with the command's exit code.

A worker is also closed as soon as the signal arrives. ``dask worker --no-nanny`` returns on
SIGTERM without closing its worker (it closes nannies only), so the close would happen while
``asyncio.run`` cancels every task, the worker's stream to the scheduler among them, and the
close could then wait its whole timeout for that stream to stop; closing first, as the command
does for nannies, avoids that.

``kill -USR2 <pid>`` makes either process write every thread's stack to its log (its stderr)
and go on: the first thing to look at when a worker hangs.

Run as ``python -m schedulers.dask_main worker|scheduler <the command's arguments>``.
"""

from __future__ import annotations

import asyncio
import atexit
import faulthandler
import os
import signal
import sys

COMMANDS = ("worker", "scheduler")
#: seconds a worker's close may take once a signal arrived
CLOSE_TIMEOUT_S = 5.0


def exit_code(code: object) -> int:
    """The process exit status ``SystemExit(code)`` stands for (a message counts as 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def close_workers_on_signal(cli) -> None:
    """Make the ``dask worker`` command module ``cli`` close its workers when the signal it
    waits for arrives, before it returns (see the module docstring). A Dask whose command or
    worker class no longer has what this relies on is left as it is."""
    from distributed import Worker

    wait = getattr(cli, "wait_for_signals", None)
    if wait is None or not hasattr(Worker, "_instances"):
        return

    async def wait_then_close() -> int:
        signum = await wait()
        await asyncio.gather(*(w.close(timeout=CLOSE_TIMEOUT_S, reason=f"signal-{signum}")
                               for w in list(Worker._instances)), return_exceptions=True)
        return signum

    cli.wait_for_signals = wait_then_close


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        sys.exit(f"usage: python -m schedulers.dask_main {{{'|'.join(COMMANDS)}}} [ARGS]...")
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # stacks on demand, into the log
    if argv[0] == "worker":
        from distributed.cli import dask_worker
        from distributed.cli.dask_worker import main as command

        close_workers_on_signal(dask_worker)
    else:
        from distributed.cli.dask_scheduler import main as command
    try:
        command(args=argv[1:], prog_name=f"dask {argv[0]}")
        code = 0
    except SystemExit as done:  # click ends its commands this way
        code = exit_code(done.code)
    atexit._run_exitfuncs()  # what a normal exit runs before tearing the modules down
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to write there
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
