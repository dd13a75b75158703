"""The entry point of the Dask processes AstraFlow starts: ``dask worker`` or ``dask scheduler``
(``distributed.cli``), then a quick exit.

When the process has closed (told to, or on SIGTERM), the interpreter's own shutdown would
still tear down every module it imported; with torch and transformers loaded by the actors
that takes a second or more per process, which every run's teardown and every cancelled job
waits for. Here the exit handlers run as usual (logging flushed, child processes reaped,
finalizers), then the process ends at once with the command's exit code.

Run as ``python -m schedulers.dask_main worker|scheduler <the command's arguments>``.
"""

from __future__ import annotations

import atexit
import os
import sys

COMMANDS = ("worker", "scheduler")


def exit_code(code: object) -> int:
    """The process exit status ``SystemExit(code)`` stands for (a message counts as 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        sys.exit(f"usage: python -m schedulers.dask_main {{{'|'.join(COMMANDS)}}} [ARGS]...")
    if argv[0] == "worker":
        from distributed.cli.dask_worker import main as command
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
