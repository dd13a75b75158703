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

Started by a run inside a Slurm job (``IGNORE_TERM_ENV``, ``schedulers.procs``), the process
ignores SIGTERM, which ``scancel`` sends to every process of the job, and stops on SIGINT, which
the run sends once it has stopped what runs on it.

Each process works in a directory of its own (`private_directory`): made here, on the process's
own node, with a random name and mode 0700 under the node's temporary directory, given to Dask
as its local directory (and its ``temporary-directory``), removed when the process exits (or,
after a SIGKILL, by the next process on the node: `remove_stale`). Dask's
default, ``$TMPDIR/dask-scratch-space``, is shared by every user of the node: Dask reuses one it
finds writable, whoever made it, and puts its folder first on ``sys.path``, so another user could
plant modules that this process imports.

Its HTTP server (a worker's health and metrics routes, which carry no token) listens on the
address the process itself listens on, never on every interface, and a worker serves none of
those routes (``DASK_DISTRIBUTED__WORKER__HTTP__ROUTES`` set by the owner brings them back).

Run as ``python -m schedulers.dask_main worker|scheduler <the command's arguments>``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import faulthandler
import fcntl
import os
import shutil
import signal
import stat
import sys
import tempfile

from schedulers.procs import exit_code

COMMANDS = ("worker", "scheduler")
#: seconds a worker's close may take once a signal arrived
CLOSE_TIMEOUT_S = 5.0
#: how the name of a process's private directory begins (the rest is random)
PRIVATE_PREFIX = "astraflow-dask-"
#: the file in a private directory that its process keeps locked while it lives
HOLD_FILE = ".astraflow-held"
_held: list[int] = []
#: set by the run's owner, this keeps Dask's own routes on the worker's HTTP server
WORKER_ROUTES_ENV = "DASK_DISTRIBUTED__WORKER__HTTP__ROUTES"


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


async def wait_for_sigint() -> int:
    """What ``dask worker``/``dask scheduler`` wait for before they close, where SIGTERM is to be
    ignored: SIGINT alone (a second one ends the process at once)."""
    loop = asyncio.get_running_loop()
    got = asyncio.Event()
    loop.add_signal_handler(signal.SIGINT, got.set)
    try:
        await got.wait()
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    return int(signal.SIGINT)


def ignore_sigterm(cli) -> None:
    """SIGTERM ignored (one line in the log each time), and the command module ``cli`` waiting for
    SIGINT alone; a Python-level handler, so the processes this one starts do not inherit it."""
    def noted(signum, frame):
        os.write(2, b"dask_main: SIGTERM ignored: the run that started this process stops it (SIGINT)\n")

    signal.signal(signal.SIGTERM, noted)
    if hasattr(cli, "wait_for_signals"):
        cli.wait_for_signals = wait_for_sigint


def option(args: list[str], name: str) -> tuple[str | None, list[str]]:
    """The value of option `name` in `args` (``--name VALUE`` or ``--name=VALUE``; the last one
    given wins, as in click) and `args` without it."""
    value, rest, i = None, [], 0
    while i < len(args):
        if args[i] == name and i + 1 < len(args):
            value, i = args[i + 1], i + 2
            continue
        if args[i].startswith(name + "="):
            value = args[i].split("=", 1)[1]
        else:
            rest.append(args[i])
        i += 1
    return value, rest


def check_base(base: str) -> None:
    """Refuse (`PermissionError`) a `base` another user could change: owned by someone other than
    us or root, or writable by group or others without the sticky bit (there they could rename
    our directory away and put theirs in its place), or one they could swap for theirs as a
    whole (a directory above it they can rename entries in, a symlink of theirs on the way)."""
    from storage.ownership import swap_problem

    st = os.stat(base)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{base} is not a directory")
    if st.st_uid not in (os.getuid(), 0):
        raise PermissionError(f"{base} belongs to uid {st.st_uid}: another user could change what is in it")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise PermissionError(f"{base} is writable by others without the sticky bit ({stat.filemode(st.st_mode)})")
    if found := swap_problem(base):
        raise PermissionError(f"{base} {found[0]}")


def private_directory(base: str) -> str:
    """A new directory under `base` that only this user can use: a random name no one could have
    made first (``mkdtemp``: created, never reused) and mode 0700, held by this process
    (`hold`). Our directories there that no live process holds (their process was killed
    outright and could not remove them) are removed first. A `base` not there yet is made (0700),
    as Dask makes its own local directory (``DASK_TEMPORARY_DIRECTORY`` naming a new one)."""
    with contextlib.suppress(FileExistsError):  # a file there: `check_base` says what it is
        os.makedirs(base, mode=0o700)
    check_base(base)
    remove_stale(base)
    path = tempfile.mkdtemp(prefix=PRIVATE_PREFIX, dir=base)
    atexit.register(remove_private_directory, path)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is not the private directory just made")  # something else is there
    try:
        hold(path)
    except OSError as err:  # a filesystem without locks: a SIGKILL then leaves the directory behind
        print(f"dask_main: {path} is not held ({err}); it is still removed at exit", file=sys.stderr)
    return path


def hold(path: str) -> None:
    """Lock `path`'s ``HOLD_FILE`` for as long as this process lives (the kernel drops the lock
    when it ends, however it ends). The file is locked before it gets its name, so a
    `remove_stale` never finds it unlocked while the directory is in use."""
    fd, tmp = tempfile.mkstemp(prefix=".hold-", dir=path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.rename(tmp, os.path.join(path, HOLD_FILE))
    _held.append(fd)  # never closed: closing would drop the lock


def remove_stale(base: str) -> None:
    """Remove the private directories of this user under `base` whose ``HOLD_FILE`` no process
    locks (best effort). A directory without one, or not ours, or not a real directory, is left."""
    try:
        entries = [e for e in os.scandir(base) if e.name.startswith(PRIVATE_PREFIX)]
    except OSError:
        return
    for entry in entries:
        try:
            st = os.lstat(entry.path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(entry.path, HOLD_FILE), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its process lives
            os.close(fd)
            continue
        try:
            shutil.rmtree(entry.path, ignore_errors=True)
        finally:
            os.close(fd)


def remove_private_directory(path: str) -> None:
    """Remove `path`, made by `private_directory` in this process, with what Dask left in it (best
    effort). Only a directory of ours is removed; ``rmtree`` does not follow links out of it."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
        shutil.rmtree(path, ignore_errors=True)


def http_host(args: list[str]) -> str:
    """Where the process's HTTP server listens: the host it listens on (``--host``, or the address
    of ``--interface``); loopback when that is every interface or cannot be told."""
    host, _ = option(args, "--host")
    interface, _ = option(args, "--interface")
    if host and host not in ("0.0.0.0", "::", "*"):
        return "localhost" if ":" in host else host  # Dask's HTTP address cannot take an IPv6 literal
    if interface and not host:
        from distributed.utils import get_ip_interface

        try:
            return get_ip_interface(interface)
        except (KeyError, ValueError):  # a wrong interface: the worker's own listen says so
            pass
    return "127.0.0.1"


def prepare(command: str, args: list[str]) -> tuple[str, list[str]]:
    """The private directory of this process, and `args` of the Dask command to run with it.

    A worker's ``--local-directory``, if given, is where its private directory is made; else
    Dask's ``temporary-directory`` setting, else the node's temporary directory (``$TMPDIR``).
    Dask's ``temporary-directory`` then names the private directory, so nothing of Dask in this
    process reaches a shared one. Without ``--dashboard-address`` the HTTP server listens on
    `http_host` (Dask's default is every interface); a worker serves no HTTP routes unless the
    owner set ``WORKER_ROUTES_ENV``."""
    import dask

    base, args = option(args, "--local-directory") if command == "worker" else (None, args)
    setting = dask.config.get("temporary-directory", None)
    try:
        private = private_directory(base or setting or tempfile.gettempdir())
    except OSError as err:  # said with where the directory came from: that is what to change
        origin = ("its --local-directory (the partition's local_directory)" if base else
                  "Dask's temporary-directory (DASK_TEMPORARY_DIRECTORY or a Dask config file)" if setting else
                  "the temp directory ($TMPDIR, else /tmp)")
        raise OSError(f"{err}; the directory is {origin}: point that at a directory only you can write") from None
    dask.config.set({"temporary-directory": private})
    if command == "worker":
        args = [*args, "--local-directory", private]
        if WORKER_ROUTES_ENV not in os.environ:
            dask.config.set({"distributed.worker.http.routes": []})
    if option(args, "--dashboard-address")[0] is None:
        args = [*args, "--dashboard-address", f"{http_host(args)}:0"]
    return private, args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        sys.exit(f"usage: python -m schedulers.dask_main {{{'|'.join(COMMANDS)}}} [ARGS]...")
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # stacks on demand, into the log
    from storage.ownership import add_user_dir

    add_user_dir()  # the user's modules (the working directory of `astraflow`), after the installed ones
    try:
        _, args = prepare(argv[0], argv[1:])
    except OSError as err:
        sys.exit(f"dask {argv[0]}: no private local directory: {err}")
    from schedulers.procs import IGNORE_TERM_ENV

    if argv[0] == "worker":
        from distributed.cli import dask_worker as cli
        from distributed.cli.dask_worker import main as command
    else:
        from distributed.cli import dask_scheduler as cli
        from distributed.cli.dask_scheduler import main as command
    if os.environ.get(IGNORE_TERM_ENV) == "1":
        ignore_sigterm(cli)
    if argv[0] == "worker":
        close_workers_on_signal(cli)
    try:
        command(args=args, prog_name=f"dask {argv[0]}")
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
