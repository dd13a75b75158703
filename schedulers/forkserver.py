"""Local worker processes forked from one process that imported their code once.

A Dask worker of a run imports Dask, torch, transformers and AstraFlow's components before it
can serve; on a laptop or a CI machine, where a run's workers share a few cores, that import
(seconds of CPU per process) is most of what starting them costs. The fork server is a plain
Python process (`serve`) that imports the given modules and then, on each request of the process
that started it, forks a child that becomes the requested command: a new session (unless the
server was made without, `ForkServer`'s ``sessions``), its log as stdout and stderr, its own
environment and working directory, then ``python -m <module> <args>`` run in it. (``ps`` shows a
child with the server's command line.)

A child stands in for a fresh ``subprocess.Popen`` of the same command only where that gives the
same process, so `ForkServer.misfit` refuses commands of another interpreter or with an
environment that differs from the server's in anything but ``ASTRAFLOW_*``, ``DASK_*`` (and
pytest's ``PYTEST_*``) (read after start: Dask's configuration is collected again in the child;
not those Dask reads at import, ``DASK_IMPORT_ENV``), or than what the server's imports set in
its environment (a library that writes the value it uses there, as torch does with its cache
directory, set the same in the starter by the same import); what it refuses is started as a
fresh process (`misfit` says why). `ForkedProcess` answers like a ``Popen``: ``pid``, ``poll``,
``wait``, ``kill``, ``returncode``. As with a ``Popen``, a child stays unreaped (a zombie, so
its pid and process group cannot be given to another process) until the starter has seen its
exit, and every child dies with the server, which dies with its starter (``PR_SET_PDEATHSIG``).
Where its processes are to ignore SIGTERM (``IGNORE_TERM_ENV``, inside a Slurm job, whose
``scancel`` signals every process), the server ignores it too: it must not take the run's
workers down before the run stopped them.

The protocol is JSON lines on the server's stdin and stdout: ``{"id", "argv", "env", "cwd",
"log", "setsid"}`` answered by ``{"id", "pid"}`` or ``{"id", "error"}``; ``{"exit": pid,
"code": c}`` when a child ended, answered by ``{"reap": pid}``. EOF on stdin stops the server.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

from schedulers.procs import IGNORE_TERM_ENV, die_with_parent, exit_code

#: what the command line of the server, and so of each child, contains
FORK_SERVER_MARK = "from schedulers.forkserver import serve"
#: environment variables a forked child may have other values of than the server (pytest's
#: describe the test running in the starter, which nothing a worker imports reads)
CHILD_ENV_PREFIXES = ("ASTRAFLOW_", "DASK_", "PYTEST_")
#: ... but not these, which Dask reads when it is imported (its configuration files, logging,
#: module constants of ``distributed``): a child would keep what the server read
DASK_IMPORT_ENV = ("DASK_CONFIG", "DASK_ROOT_CONFIG", "DASK_INTERNAL_INHERIT_CONFIG", "DASK_LOGGING",
                   "DASK_DISTRIBUTED__LOGGING", "DASK_DISTRIBUTED__ADMIN__PDB", "DASK_DISTRIBUTED__ADMIN__LOG",
                   "DASK_DISTRIBUTED__COMM__SHARD", "DASK_DISTRIBUTED__COMM__OFFLOAD",
                   "DASK_DISTRIBUTED__DIAGNOSTICS__CUDF")
#: torch asks NVML, not CUDA, whether there is a GPU where this is "1"
NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
#: seconds the first fork request waits for the server's imports
READY_TIMEOUT_S = 600.0
#: `ForkServer.misfit` of a server whose imports outlasted the wait
NOT_READY = "the fork server did not answer (it hangs)"
#: seconds a fork request waits for its answer once the server is ready
FORK_TIMEOUT_S = 30.0


class ForkServerError(RuntimeError):
    """The fork server could not start the command (it is gone, or the fork failed)."""


class ForkedProcess:
    """A child of the fork server, answering like ``subprocess.Popen``."""

    def __init__(self, server: "ForkServer", pid: int, args: Sequence[str]):
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._server = server

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server._exit_code(self.pid)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the child (a no-op once it was seen to end: until then its pid is still its
        own, unreaped)."""
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            self.returncode = self._server._wait_exit(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


class ForkServer:
    """The starter's side: runs the server (`serve`) importing `modules`, with `env` and its
    stderr appended to `log`, and forks children from it on request. `sessions`: the server and
    each child lead sessions of their own (local workers, which are cancelled by their group);
    False keeps them in the starter's process group, as plain subprocesses would be (what
    stops the starter's group stops them and what they started). `cwd`: the server's working
    directory (default: the starter's), where ``-c`` lets it import from."""

    def __init__(self, python: str, modules: Sequence[str], env: Mapping[str, str], log: str | Path,
                 sessions: bool = True, cwd: str | Path | None = None):
        self.python = python
        self.sessions = sessions
        self.env = dict(env)
        self.log = Path(log)
        with open(self.log, "ab") as err:
            self._proc = subprocess.Popen(
                # -c, not -m: run as __main__, this module would be imported a second time by its package
                [python, "-c", f"import sys; {FORK_SERVER_MARK}; serve(sys.argv[1:])", *modules],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=self.env, bufsize=0,
                start_new_session=sessions, preexec_fn=die_with_parent, cwd=cwd,
            )
        self._cond = threading.Condition()
        self._sending = threading.Lock()  # one message at a time on the pipe (a request can be long)
        self._answers: dict[int, dict] = {}
        self._exits: dict[int, int] = {}
        self._reaped: set[int] = set()
        self._abandoned: set[int] = set()  # requests whose answer came too late for `start`
        self._ready = False
        self._imported_env: dict[str, str] = {}  # the server's environment after its imports
        self._gone = False
        self._next_id = 0
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return not self._gone

    def misfit(self, argv: Sequence[str], env: Mapping[str, str], timeout: float = READY_TIMEOUT_S) -> str | None:
        """Why a child forked for `argv` with `env` would not be the process a fresh start would
        be (None: it would). Waits up to `timeout` for the server's imports where the answer
        depends on them; a server not ready by then is a misfit."""
        if self._gone:
            return "the fork server is gone"
        if len(argv) < 3 or argv[0] != self.python or argv[1] != "-m":
            return f"the command is not `{self.python} -m MODULE ...`"
        differ = sorted(k for k in set(env) | set(self.env) if env.get(k) != self.env.get(k)
                        and (not k.startswith(CHILD_ENV_PREFIXES) or k.upper().startswith(DASK_IMPORT_ENV)))
        if differ and all(env.get(k) == os.environ.get(k) for k in differ):
            # each set in this process since the server started: by an import the server made
            # too, to the same value? (known once its imports are done)
            with self._cond:
                self._cond.wait_for(lambda: self._ready or self._gone, timeout)
            if self._gone:
                return "the fork server is gone"
            if not self._ready:
                return NOT_READY
            differ = [k for k in differ if env.get(k) != self._imported_env.get(k)]
        return f"its environment sets {', '.join(differ)} otherwise" if differ else None

    def start(self, argv: Sequence[str], env: Mapping[str, str], log: str | Path,
              cwd: str | Path | None = None, ready_timeout: float = READY_TIMEOUT_S) -> ForkedProcess:
        """Fork ``argv`` (``python -m module args...``); `ForkServerError` when that failed or
        took too long (the server's imports more than `ready_timeout` seconds; a child forked
        after that is killed: the caller starts another)."""
        with self._cond:
            request_id = self._next_id
            self._next_id += 1
        self._send({"id": request_id, "argv": list(argv), "env": dict(env), "cwd": str(cwd or os.getcwd()),
                    "log": str(log), "setsid": self.sessions})
        with self._cond:  # the imports first (the server reads the request after them), then the fork
            self._cond.wait_for(lambda: self._ready or self._gone, ready_timeout)
            if self._ready:
                self._cond.wait_for(lambda: request_id in self._answers or self._gone, FORK_TIMEOUT_S)
            answer = self._answers.pop(request_id, None)
            if answer is None:  # a child forked for it later is killed (`_read`): nobody knows of it
                self._abandoned.add(request_id)
        if answer is None:
            raise ForkServerError(f"the fork server did not answer (it {'ended' if self._gone else 'hangs'}); "
                                  f"see {self.log}")
        if "error" in answer:
            raise ForkServerError(f"the fork server could not start {argv[2]}: {answer['error']}")
        return ForkedProcess(self, int(answer["pid"]), argv)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the server (its children that still run are killed with it)."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout)
        self._reader.join(timeout)

    def _send(self, message: dict) -> None:
        data = memoryview(json.dumps(message).encode() + b"\n")
        try:
            with self._sending:
                while data:  # a pipe may take part of it (a signal while the write waited for room)
                    data = data[self._proc.stdin.write(data):]  # type: ignore[union-attr]
        except (OSError, ValueError) as err:  # the server is gone
            with self._cond:
                self._gone = True
                self._cond.notify_all()
            raise ForkServerError(f"the fork server is gone ({err}); see {self.log}") from None

    def _read(self) -> None:
        for line in self._proc.stdout:  # type: ignore[union-attr]
            try:
                message = json.loads(line)
            except ValueError:
                continue
            late = None
            with self._cond:
                if "ready" in message:
                    self._ready = True
                    self._imported_env = dict(message.get("env") or {})
                elif "exit" in message:
                    self._exits[int(message["exit"])] = int(message["code"])
                elif int(message["id"]) in self._abandoned:
                    self._abandoned.discard(int(message["id"]))
                    late = message.get("pid")
                else:
                    self._answers[int(message["id"])] = message
                self._cond.notify_all()
            if late is not None:  # unreaped until we say so: the pid is still that child's
                _kill_late(int(late))
        with self._cond:  # its children were killed with it
            self._gone = True
            self._cond.notify_all()

    def _exit_code(self, pid: int) -> int | None:
        """The exit status of child `pid` once it ended; the first caller to see it has the
        server reap it (so, as with ``Popen``, the pid stays the child's until someone saw it end)."""
        with self._cond:
            code = self._exits.get(pid)
            if code is None:
                return -signal.SIGKILL if self._gone else None
            first = pid not in self._reaped
            self._reaped.add(pid)
        if first:
            try:
                self._send({"reap": pid})
            except ForkServerError:  # gone: its zombies went with it
                pass
        return code

    def _wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self._gone, timeout)
        return self._exit_code(pid)


def _kill_late(pid: int) -> None:
    """SIGKILL a child forked after its `start` gave up, with its group where it made one."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # no group yet (its setsid still to come)
            continue


# ---- the server's side ----------------------------------------------------------------------

def _exit_status(info: os.waitid_result) -> int:
    """``Popen.returncode`` of a child from its ``waitid`` record."""
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


class _Server:
    def __init__(self) -> None:
        # the protocol on descriptors of its own: what an import prints goes to the log instead
        self.requests = os.dup(0)
        self.answers = os.dup(1)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(2, 1)
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        self.children: set[int] = set()  # running, or ended and not yet reported
        self.reported: set[int] = set()  # ended and reported, waiting for the starter's "reap"
        self.refusal: str | None = None  # why no child can be forked from this process

    def serve(self, modules: Sequence[str]) -> None:
        if os.environ.get(IGNORE_TERM_ENV) == "1":  # stopped by its starter alone (module docstring)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # an import asking torch whether there is a GPU must not initialise CUDA here: a forked
        # child could not use it (this process's environment only; each child gets its own)
        nvml = os.environ.get(NVML_CHECK_ENV)
        os.environ[NVML_CHECK_ENV] = "1"
        for name in modules:
            try:
                importlib.import_module(name)
            except BaseException:  # the child that needs it fails the same way, in its own log
                print(f"forkserver: importing {name} failed:", file=sys.stderr)
                traceback.print_exc()
        self.refusal = _cuda_refusal()
        gc.freeze()  # what the imports made: children's collections skip it (no page copied to scan it)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w)
        imported = {**os.environ, NVML_CHECK_ENV: nvml}
        self._answer({"ready": True, "env": {k: v for k, v in imported.items() if v is not None}})
        pending = b""
        while True:
            try:
                readable, _, _ = select.select([self.requests, self.wake_r], [], [])
            except InterruptedError:
                readable = []
            if self.wake_r in readable:
                while True:
                    try:
                        if not os.read(self.wake_r, 512):
                            break
                    except BlockingIOError:
                        break
            self._report_exits()
            if self.requests in readable:
                chunk = os.read(self.requests, 65536)
                if not chunk:
                    return  # the starter closed us (or died): the children go with this process
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        self._handle(json.loads(line))

    def _handle(self, message: dict) -> None:
        if "reap" in message:
            pid = int(message["reap"])
            if pid in self.reported:
                os.waitpid(pid, 0)
                self.reported.discard(pid)
            return
        if self.refusal:
            self._answer({"id": message["id"], "error": self.refusal})
            return
        try:
            pid = os.fork()
        except OSError as err:
            self._answer({"id": message["id"], "error": f"{type(err).__name__}: {err}"})
            return
        if pid == 0:
            _become(message, keep_out=(self.requests, self.answers, self.wake_r, self.wake_w))
        self.children.add(pid)
        self._answer({"id": message["id"], "pid": pid})

    def _report_exits(self) -> None:
        """Tell the starter about each child that ended, leaving it unreaped until it says so."""
        for pid in list(self.children):
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                info = None
                self.children.discard(pid)
            if info is not None:
                self.children.discard(pid)
                self.reported.add(pid)
                self._answer({"exit": pid, "code": _exit_status(info)})

    def _answer(self, message: dict) -> None:
        data = json.dumps(message).encode() + b"\n"
        while data:
            data = data[os.write(self.answers, data):]


def _cuda_refusal() -> str | None:
    """Why the imports left this process unfit to fork from: CUDA initialised (a forked child
    cannot use it). None: fit."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "an import initialised CUDA in the fork server, which its children could not use"
    return None


def _become(request: dict, keep_out: Sequence[int]) -> None:
    """In the forked child: turn into ``request``'s command, run it, and exit with its status."""
    code = 1
    try:
        if request.get("setsid", True):
            os.setsid()
        die_with_parent()
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
        for fd in keep_out:
            os.close(fd)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        argv = request["argv"]
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _fresh_state()
        module, args = argv[2], argv[3:]
        sys.argv = [module, *args]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as done:
            code = exit_code(done.code)
        atexit._run_exitfuncs()  # what a normal exit runs
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _fresh_state() -> None:
    """What the imports computed from the server's environment or that all children would
    share: Dask's configuration (collected again from this environment) and the global random
    states of numpy and torch (seeded anew, as in a fresh process; Python's ``random`` is on
    its own after a fork)."""
    if "dask.config" in sys.modules:
        sys.modules["dask.config"].refresh()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    if "torch" in sys.modules:  # its CPU generator (CUDA's are made in the child: no CUDA here)
        sys.modules["torch"].default_generator.seed()


def serve(modules: Sequence[str]) -> None:
    """The server's main: import `modules`, then fork on request until stdin closes; then end
    at once, as ``schedulers.dask_main`` does: the interpreter's teardown of what it imported
    (torch, transformers) would cost seconds that the run's shutdown waits for, and there is
    nothing of this process's own to flush but its log."""
    _Server().serve(modules)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)
