"""Sandbox: run a model-written program and its tests in bubblewrap, bounded and cleaned up.

One execution: a fresh input directory (the runner, the program, the tests) under the scratch
root, bound read-only inside; bubblewrap started in a process group of its own with its own
user, PID, network, mount, IPC and UTS namespaces; its output read with a cap until it exits
or the wall-clock deadline passes; then its process group killed (the PID namespace dies with
its init, taking every process of the program with it) and the input directory removed.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import importlib.util
import logging
import marshal
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from storage.ownership import make_parents, swap_problem

from . import bwrap
from .config import SandboxConfig
from .result import SandboxResult, events, judged, result

log = logging.getLogger("astraflow.sandbox")
RUNNER = (Path(__file__).with_name("runner.py")).read_text(encoding="utf-8")
#: the isolated tests' judge, its wire and proxies first (``judge.py``)
JUDGE = "\n".join(Path(__file__).with_name(name).read_text(encoding="utf-8")
                  for name in ("wire.py", "remote.py", "judge.py"))
#: ``runner.py`` where the host compiled the runner (``runner.bin``): it runs that as the runner would run
BOOT = ("import marshal\nwith open('/in/runner.bin', 'rb') as f:\n    code = marshal.loads(f.read())\n"
        "exec(code, {'__name__': '__main__', '__file__': '/in/runner.py', '__builtins__': __builtins__})\n")
MAX_CHANNEL_BYTES = 1 << 20  # the result pipe: a few lines per test
EXIT_GRACE_S = 1.0  # after bubblewrap exits, how long its pipes may take to close
PIPE_BYTES = 4096  # what a pipe surely takes before a writer blocks (one page: Linux shrinks pipes past a user's quota)


class Sandbox:
    """Runs programs in bubblewrap; at most ``cfg.concurrency`` at once (callers wait)."""

    def __init__(self, cfg: SandboxConfig = SandboxConfig()):
        self.cfg = cfg
        self._slots = threading.BoundedSemaphore(cfg.concurrency)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._checked = False
        self._root = Path()
        #: the runner and the isolated tests' judge as the input directory holds them: compiled
        #: here (``runner.bin``, ``judge.bin``) when the sandbox interpreter reads this
        #: interpreter's bytecode (an execution then compiles neither), else their source
        self._code = {"runner.py": RUNNER.encode()}
        self._judge: tuple[str, bytes] = ("judge.py", JUDGE.encode())
        #: how bubblewrap is started as the sandbox's user (``bwrap.launcher``), found once
        self._launcher: tuple[list[str], dict] = ([], {})
        #: (``bwrap.sandbox_args``, the interpreter): the argv every execution starts with
        self._argv: tuple[list[str], str] | None = None
        #: the sandbox's /etc, staged under the scratch root (``bwrap.stage_etc``); None: file by file
        self._etc: str | None = None
        #: per thread: [seconds it waited for a slot, when its current wait began or None]
        self._queued: dict[int, list] = {}

    def check(self) -> None:
        """Raise SandboxUnavailable (naming the fix) unless bubblewrap works here and an
        execution directory can be made under the scratch root; once."""
        with self._lock:
            if not self._checked:
                self._launcher = bwrap.launcher(self.cfg)
                self._root = self._scratch_root()
                self._etc = bwrap.stage_etc(self._root)
                if bwrap.probe(self.cfg, self._etc) == importlib.util.MAGIC_NUMBER.hex():  # it runs what we compile
                    self._code = {"runner.py": BOOT.encode(),
                                  "runner.bin": marshal.dumps(compile(RUNNER, "/in/runner.py", "exec"))}
                    self._judge = ("judge.bin", marshal.dumps(compile(JUDGE, "/in/judge.py", "exec")))
                if os.getpid() == 1:  # orphans are ours to reap, and nothing here reaps them
                    log.warning("this process is PID 1 (a container without an init): each sandbox run leaves a "
                                "zombie process that only PID 1 can reap; start the container with an init "
                                "(docker run --init, tini, or apptainer's default)")
                try:
                    shutil.rmtree(self._input_dir("", None))
                except OSError as err:
                    raise bwrap.SandboxUnavailable(
                        f"cannot make an execution directory under the sandbox's scratch root {self._root} "
                        f"({err.strerror or err}): set sandbox.scratch_root to a directory you can write") from None
                self._checked = True

    def _scratch_root(self) -> Path:
        """The directory execution inputs go under: ``sandbox.scratch_root``, else this user's
        own in the temp dir; made if missing (0700, 0711 when the sandbox runs as another uid,
        whatever the umask; missing directories above it never writable by others). Refused unless it is our
        directory, no one else can write it and no one else can swap it for theirs (a directory
        above it they can rename entries in, a symlink of theirs on the way): another user could
        read the tests there, or swap an execution's inputs for a runner that reports a pass.
        Run as another uid, the sandbox must pass through every directory above it."""
        drop = bwrap.sandbox_id(self.cfg) is not None
        default = Path(tempfile.gettempdir()) / f"astraflow-sandbox-{os.geteuid()}"
        root = Path(self.cfg.scratch_root or default).absolute()
        try:
            make_parents(root)
            try:
                os.mkdir(root, 0o700)
                os.chmod(root, 0o711 if drop else 0o700)
            except FileExistsError:
                pass
            st = os.lstat(root)
        except OSError as err:
            why = f"{err.filename}: {err.strerror}" if err.filename and err.strerror else str(err)
            raise bwrap.SandboxUnavailable(
                f"cannot create the sandbox's scratch root {root} ({why}): set "
                "sandbox.scratch_root to a directory you can write") from None
        problem, fix = _not_ours(st), "remove it, or set sandbox.scratch_root to a directory only you can write"
        if problem is None and (found := swap_problem(root)) is not None:  # swappable from above
            problem, fix = found[0], "set sandbox.scratch_root to a directory only you can write"
            if found[1]:
                fix = f"{found[1]} {fix}" if found[1].endswith(" or") else f"{fix} ({found[1]})"
        if problem:
            raise bwrap.SandboxUnavailable(
                f"the sandbox's scratch root {root} {problem}: another user could read the tests under it or "
                f"forge results; {fix}")
        if drop:
            for d in (root, *root.parents):
                if not os.stat(d).st_mode & 0o001:
                    raise bwrap.SandboxUnavailable(
                        f"the sandbox runs as uid {self.cfg.sandbox_uid}, which cannot pass through {d} (mode "
                        f"{os.stat(d).st_mode & 0o777:04o}) to reach its inputs under {root}: set "
                        "sandbox.scratch_root to a directory under one it can (e.g. /tmp), or chmod o+x it")
        return root

    def run(self, program: str | bytes, tests: str | None = None, *,
            timeout_s: float | None = None) -> SandboxResult:
        """Run ``program`` then each ``test_*`` of ``tests`` in its namespace; blocking."""
        if not isinstance(program, (str, bytes)):
            raise TypeError(f"program must be str or bytes, not {type(program).__name__}")
        if tests is not None and not isinstance(tests, str):
            raise TypeError(f"tests must be str or None, not {type(tests).__name__}")
        timeout = self.cfg.timeout_s if timeout_s is None else float(timeout_s)
        if not timeout > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.check()
        self._acquire_slot()
        try:
            return self._execute(program, tests, timeout)
        finally:
            self._slots.release()

    def _acquire_slot(self) -> None:
        ident = threading.get_ident()
        with self._lock:
            entry = self._queued.setdefault(ident, [0.0, None])
            entry[1] = time.monotonic()
        try:
            self._slots.acquire()
        finally:
            with self._lock:
                entry[0] += time.monotonic() - entry[1]
                entry[1] = None

    def queued_s(self, ident: int) -> float:
        """Seconds thread ``ident`` has waited for a slot since ``forget_queued(ident)``."""
        with self._lock:
            waited, since = self._queued.get(ident, (0.0, None))
            return waited + (time.monotonic() - since if since is not None else 0.0)

    def forget_queued(self, ident: int) -> None:
        with self._lock:
            self._queued.pop(ident, None)

    async def arun(self, program: str | bytes, tests: str | None = None, *,
                   timeout_s: float | None = None, deadline_s: float | None = None) -> SandboxResult:
        """``run`` on the sandbox's own bounded thread pool: the event loop never blocks.
        ``deadline_s``: raise ``TimeoutError`` past it, not counting the wait for a slot."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.cfg.concurrency, thread_name_prefix="sandbox")
        return await run_within(self._pool, lambda: self.run(program, tests, timeout_s=timeout_s),
                                deadline_s, self)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    # -- one execution --------------------------------------------------------------------

    def _execute(self, program: str | bytes, tests: str | None, timeout: float) -> SandboxResult:
        start = time.monotonic()
        try:
            in_dir = self._input_dir(program, tests)
        except OSError as err:
            return result("sandbox_error", (), "", f"sandbox could not write its inputs: {err}", None, start)
        try:
            return self._spawn_and_collect(in_dir, tests, timeout, start)
        finally:
            shutil.rmtree(in_dir, ignore_errors=True)

    def _input_dir(self, program: str | bytes, tests: str | None) -> str:
        """A fresh directory of the inputs, readable by us only (the tests must not leak to other
        users); when the sandbox runs as another uid, also by its group, read-only."""
        path = tempfile.mkdtemp(prefix="exec-", dir=self._root)  # 0700
        try:
            files = {**self._code,
                     "program.py": _utf8(program) if isinstance(program, str) else program}
            if tests is not None and self.cfg.isolate_tests:  # the tests come on the runner's stdin
                files[self._judge[0]] = self._judge[1]
            elif tests is not None:
                files["tests.py"] = _utf8(tests)
            gid = bwrap.sandbox_id(self.cfg)
            for name, data in files.items():
                fd = os.open(os.path.join(path, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with open(fd, "wb") as f:
                    f.write(data)
                    if gid is not None:
                        os.fchown(fd, -1, gid)
                        os.fchmod(fd, 0o640)
            if gid is not None:
                os.chown(path, -1, gid)
                os.chmod(path, 0o750)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        return path

    def _spawn_and_collect(self, in_dir: str, tests: str | None, timeout: float,
                           start: float) -> SandboxResult:
        cfg = self.cfg
        nonce = secrets.token_hex(16)
        names = [] if tests is None else test_names(tests)
        r_fd, w_fd = os.pipe()
        fds = [w_fd]
        try:
            filter_fd = bwrap.seccomp_fd()
            fds += [] if filter_fd is None else [filter_fd]
            prefix, as_user = self._launcher
            if self._etc is not None and not os.path.isdir(self._etc):  # removed under us (a /tmp cleaner)
                self._etc, self._argv = bwrap.stage_etc(self._root), None
            if self._argv is None:  # found once: bubblewrap, the interpreter, what is bound
                python = bwrap.interpreter(cfg)
                self._argv = (bwrap.sandbox_args(cfg, python, self._etc), python)
            cmd = [*prefix, *bwrap.command(cfg, *self._argv, in_dir, w_fd, names, filter_fd)]
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, pass_fds=fds, process_group=0,
                                    env=bwrap.HOST_ENV, **as_user)
        except (OSError, bwrap.SandboxUnavailable) as err:
            os.close(r_fd)
            for fd in fds:
                os.close(fd)
            return result("sandbox_error", (), "", f"sandbox could not start: {err}", None, start)
        for fd in fds:
            os.close(fd)
        feed = nonce.encode() + b"\n"
        if tests is not None and cfg.isolate_tests:  # only the judge reads them, never the program's process
            feed += _utf8(tests)
        _feed(proc, feed)
        out, err, channel, killed = _collect(proc, r_fd, start + timeout, cfg.max_output_bytes)
        return judged(proc.returncode, out, err, events(channel, nonce), killed, names, start, cfg.cpu_s)


def _feed(proc: subprocess.Popen, data: bytes) -> None:
    """``data`` to the runner's stdin, then closed. What a pipe holds is written here; more from a
    thread, so that a runner that never reads cannot hold this call past the deadline."""

    def write() -> None:
        try:
            proc.stdin.write(data)
        except OSError:
            pass  # bubblewrap already failed (its stderr says why), or the runner was killed
        finally:
            try:
                proc.stdin.close()
            except OSError:
                pass

    if len(data) <= PIPE_BYTES:
        write()
    else:
        threading.Thread(target=write, name="sandbox-stdin", daemon=True).start()


def _collect(proc: subprocess.Popen, r_fd: int, deadline: float,
             cap: int) -> tuple[bytes, bytes, bytes, str | None]:
    """Read stdout, stderr and the result pipe until they close or a limit trips, then kill
    the process group and wait. Returns the bytes read and why it was killed (or None)."""
    sel = selectors.DefaultSelector()
    o_fd, e_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {o_fd: bytearray(), e_fd: bytearray(), r_fd: bytearray()}
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    killed, exited_at = None, None
    try:
        while sel.get_map():
            now = time.monotonic()
            if proc.poll() is not None and exited_at is None:
                exited_at = now
            if exited_at is not None and now > exited_at + EXIT_GRACE_S:
                break
            if now >= deadline:
                killed = "timeout"
                break
            for key, _ in sel.select(timeout=min(0.1, max(deadline - now, 0.001))):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                bufs[key.fd] += chunk
            shown = len(bufs[o_fd]) + len(bufs[e_fd])
            if shown > cap or len(bufs[r_fd]) > MAX_CHANNEL_BYTES:
                killed = "output_limit"
                break
    finally:
        sel.close()
        _kill(proc)
        for f in (proc.stdout, proc.stderr):
            f.close()
        os.close(r_fd)
    out, err = bytes(bufs[o_fd]), bytes(bufs[e_fd])
    if len(out) + len(err) > cap:
        out = out[:cap]
        err = err[:max(cap - len(out), 0)]
    return out, err, bytes(bufs[r_fd]), killed


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL bubblewrap's process group and reap it; its sandbox init then gets SIGKILL too
    (--die-with-parent) and the kernel kills everything left in the PID namespace."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


async def run_within(executor: Any, fn: Callable[[], Any], deadline_s: float | None, sandbox: Sandbox) -> Any:
    """``fn()`` on ``executor``; ``TimeoutError`` once it has run ``deadline_s`` seconds, not
    counting the time it waited for a thread of the executor or a slot of ``sandbox`` (queueing
    behind other programs is not the caller's program running long). ``None``: no deadline.
    A call past its deadline is abandoned: its thread finishes on its own."""
    loop = asyncio.get_running_loop()
    started: list[tuple[int, float]] = []

    def timed() -> Any:
        ident = threading.get_ident()
        sandbox.forget_queued(ident)
        started.append((ident, time.monotonic()))
        return fn()

    fut = loop.run_in_executor(executor, timed)
    if deadline_s is None:
        return await fut
    while True:
        left = deadline_s
        if started:
            ident, t0 = started[0]
            left = deadline_s - (time.monotonic() - t0 - sandbox.queued_s(ident))
        if left <= 0:
            raise TimeoutError(f"ran past its {deadline_s:g} s deadline")
        done, _ = await asyncio.wait({fut}, timeout=max(left, 0.01))
        if done:
            return fut.result()


def test_names(tests: str) -> list[str]:
    """The tests' top-level ``test_*`` functions in order, or ["tests"] when there are none
    (the whole source is one test). The tests come from the workload, not the model."""
    return list(_names(tests))


@functools.lru_cache(maxsize=64)  # a group's samples share their task's tests
def _names(tests: str) -> tuple[str, ...]:
    try:
        tree = ast.parse(tests.removeprefix("\ufeff"))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return ("tests",)
    names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
             and n.name.startswith("test_")]
    return tuple(dict.fromkeys(names)) or ("tests",)


def _utf8(text: str) -> bytes:
    """``text`` as the file the runner reads. A lone surrogate is no character: it is written as
    bytes that are not UTF-8 either, so the run fails as a program that is not UTF-8 (a result,
    not an exception out of ``run``)."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def _not_ours(st: os.stat_result) -> str | None:
    """Why a scratch root with this lstat is unsafe to hold execution inputs, or None."""
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return "is not a directory (a symbolic link or a file)"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {st.st_mode & 0o777:04o})"
    return None
