"""Starting the Megatron backend's rank processes, and each rank's control channel.

Both launchers give the backend the same thing: one ``multiprocessing.connection.Connection``
per rank (in rank order), the per-rank log files, the ranks that have exited, and a way to stop
them all.

* ``LocalRanks`` (one node; the default): ``world`` processes on this host, forked from the
  process's rank fork server (``rank_server``: torch and Megatron imported once for all
  its backends) or, where a fork cannot stand in for a fresh start, plain subprocesses;
  ``file://`` rendezvous in the backend's private (0700) work directory, where each rank
  connects back to a Unix socket and proves the launch's token as under srun. No port.
* ``SrunRanks`` (a trainer job that spans several nodes): one ``srun`` job step inside the
  trainer's own Slurm job starts the ranks on every node of the allocation (``srun_command``);
  ``env://`` rendezvous (``MASTER_ADDR`` = the first node, where the backend runs, and a free
  ``MASTER_PORT``); ranks take ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` from ``SLURM_PROCID``/
  ``SLURM_NTASKS``/``SLURM_LOCALID``. Each rank connects back over TCP to a listener of the
  backend, and both sides prove they hold the launch's secret token (``multiprocessing.connection``'s
  HMAC challenge, both ways) before anything is unpickled: others on the cluster reach that port.

The rank side of both is ``rank_spec`` and ``rank_channel``; ``slurm`` reads the allocation.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from pathlib import Path

import psutil

from astraflow.training.backend import BackendProcessLost
from astraflow.training.megatron.slurm import Allocation, cancel_step, srun_command
from astraflow.training.megatron import rank_server
from astraflow.training.megatron.rank_server import RANK_MODULE
from schedulers.forkserver import NOT_READY, ForkedProcess, ForkServer, ForkServerError

#: the Unix socket local ranks connect to, in the backend's private work directory (also the
#: ranks' working directory, so they name it relative to it whatever the directory's length)
CONTROL_SOCKET = "ranks.sock"
#: longest path ``bind`` takes for a Unix socket (``sun_path`` less its terminating byte)
_SUN_PATH_MAX = 107
#: a rank's hello after the handshake is a small JSON object; anything longer is refused
_HELLO_MAX = 4096


class RankError(RuntimeError):
    """A rank process died or did not answer in time; carries the tail of its log."""


class RankKilled(RankError, BackendProcessLost):
    """A rank process was killed by SIGKILL (the out-of-memory killer, most often): nothing in
    its log says why, and a new backend may well run where this one ran."""


def how_ended(code: int | None) -> str | None:
    """A process's exit status (``Popen.returncode``) in words; None while it runs."""
    if code is None:
        return None
    if code >= 0:
        return f"ended with exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"was killed by {name}" + (", as the out-of-memory killer kills" if -code == signal.SIGKILL else "")


@dataclass(frozen=True)
class RankLaunch:
    """What every launcher needs: the layout, the ranks' environment, where logs go."""

    world: int
    tp_size: int
    dp_size: int
    #: the whole environment of a rank process (the launcher adds its rendezvous keys)
    env: dict[str, str]
    log_dir: Path
    #: the backend's private directory (rendezvous file, the ranks' working directory)
    workdir: Path

    def spec(self, **extra) -> str:
        """``ASTRAFLOW_RANK_SPEC``: the layout, the rendezvous and, from a local launch, the rank."""
        return json.dumps({"world_size": self.world, "tp_size": self.tp_size, "dp_size": self.dp_size, **extra})

    def log(self, rank: int) -> Path:
        return self.log_dir / f"megatron-rank{rank}.log"


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _left_behind(workdir: Path) -> list[psutil.Process]:
    """Processes of this process's group working in ``workdir`` (a backend's private work
    directory, the ranks' working directory): what a rank started, orphaned when it died."""
    group, me, root = os.getpgrp(), os.getpid(), str(workdir)
    out = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):  # ended, or not ours to look at
            if proc.pid != me and os.getpgid(proc.pid) == group and proc.cwd().startswith(root):
                out.append(proc)
    return out


def _unix_listener(workdir: Path, backlog: int) -> socket.socket:
    """A listening Unix socket ``CONTROL_SOCKET`` in ``workdir`` (bound through the directory's
    descriptor where the full path is longer than a socket address holds)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = str(workdir / CONTROL_SOCKET)
    try:
        if len(path.encode()) <= _SUN_PATH_MAX:
            server.bind(path)
        else:
            dirfd = os.open(workdir, os.O_RDONLY)
            try:
                server.bind(f"/proc/self/fd/{dirfd}/{CONTROL_SOCKET}")
            finally:
                os.close(dirfd)
        server.listen(backlog)
    except BaseException:
        server.close()
        raise
    return server


class LocalRanks:
    """``world`` processes on this host, each connected back over a Unix socket with the
    launch's token (see the module docstring). ``fork``: fork them from ``rank_server``
    where it can stand in for a fresh start; a rank started fresh says why in its log."""

    def __init__(self, launch: RankLaunch, start_timeout_s: float, fork: bool = True):
        self.logs = [launch.log(r) for r in range(launch.world)]
        self.launcher_logs: list[Path] = []
        self.procs: list[subprocess.Popen | ForkedProcess] = []
        self.conns: list[Connection] = []
        self.workdir = launch.workdir
        token = secrets.token_hex(32)
        env = dict(launch.env)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ranks share this host
        init_method = f"file://{launch.workdir / 'rendezvous'}"
        deadline = time.monotonic() + start_timeout_s
        listener = _unix_listener(launch.workdir, launch.world)
        try:
            kept_logs = launch.log_dir if launch.log_dir != launch.workdir else None  # outlives this backend
            forker = rank_server.rank_fork_server(env, kept_logs) if fork else None
            for r in range(launch.world):
                rank_env = dict(env, ASTRAFLOW_RANK_SPEC=launch.spec(rank=r, init_method=init_method),
                                ASTRAFLOW_RANK_CONTROL=f"unix:{CONTROL_SOCKET}", ASTRAFLOW_RANK_TOKEN=token)
                proc = _start_rank(forker, rank_env, self.logs[r], launch.workdir, deadline)
                if forker is not None and rank_server.current() is not forker:  # given up: the next start fresh
                    forker = None
                self.procs.append(proc)
            self.conns, _ = accept_ranks(listener, token.encode(), launch.world, deadline, self._check_running)
        except BaseException:
            self.kill()
            raise
        finally:
            listener.close()

    def _check_running(self) -> None:
        if dead := self.exited():
            raise RankError(f"rank(s) {dead} exited before connecting to the backend; see "
                            + ", ".join(str(self.logs[r]) for r in dead))

    def exited(self) -> list[int]:
        """The ranks whose process has ended."""
        return [i for i, p in enumerate(self.procs) if p.poll() is not None]

    def exit_codes(self, ranks: list[int]) -> dict[int, int | None]:
        """Each of ``ranks``' exit status (``Popen.returncode``: negative for a signal; None: running)."""
        return {r: self.procs[r].poll() for r in ranks if r < len(self.procs)}

    def wait(self, timeout_s: float) -> None:
        for p in self.procs:
            p.wait(timeout=timeout_s)

    def kill(self) -> None:
        """Stop the processes this launcher started and close the channels, with what the ranks
        started (multiprocessing helpers): a live rank's descendants, and what a rank that died
        (the OOM killer) left behind. The ranks, forked or not, stay in this process's group, so a
        scheduler that stops the worker by its group stops them and what they started too."""
        live = [p for p in self.procs if p.poll() is None]
        strays = [c for p in live for c in _descendants(p.pid)] + _left_behind(self.workdir)
        for p in live:
            p.kill()
        for c in strays:
            with contextlib.suppress(psutil.Error):  # ended meanwhile
                c.kill()
        for p in self.procs:
            p.wait(timeout=30)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []


def _start_rank(forker: ForkServer | None, env: dict[str, str], log: Path, workdir: Path,
                deadline: float) -> subprocess.Popen | ForkedProcess:
    """One rank, forked from ``forker`` where it can stand in, else a fresh subprocess. A server that
    fails or outlasts the start ``deadline`` is given up (`rank_server.give_up`): ranks start fresh."""
    argv = [sys.executable, "-m", RANK_MODULE]
    left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
    why = "forking ranks is off" if forker is None else forker.misfit(argv, env, left())
    if why == NOT_READY:
        rank_server.give_up(forker, close=True)  # it forked nothing: nothing of it runs
    if why is None:
        try:
            return forker.start(argv, env, log, cwd=workdir, ready_timeout=left())
        except ForkServerError as err:
            why = str(err)
            rank_server.give_up(forker)
    with open(log, "ab") as fh:
        if forker is not None:
            fh.write(f"astraflow: rank started as a fresh process, not forked: {why}\n".encode())
            fh.flush()
        return subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=workdir)


class SrunRanks:
    """The ranks as one ``srun`` job step of the allocation the backend runs in, each connected
    back over TCP with the launch's token (see the module docstring)."""

    def __init__(self, launch: RankLaunch, allocation: Allocation, start_timeout_s: float):
        self.world = launch.world
        self.logs = [launch.log(r) for r in range(launch.world)]
        self.srun_log = launch.log_dir / "megatron-srun.log"
        self.launcher_logs = [self.srun_log]
        self.conns: list[Connection] = []
        self.allocation = allocation
        #: ``job.step`` of the ranks' step, as the ranks report it (for ``scancel``)
        self.step: str | None = None
        #: per rank: its Slurm node, host and pid, as the ranks report them
        self.where: list[dict] = []
        token = secrets.token_hex(32)
        server = socket.create_server((allocation.master_addr, 0))
        host, port = server.getsockname()[:2]
        env = dict(launch.env)
        env.update(
            ASTRAFLOW_RANK_SPEC=launch.spec(init_method="env://"),
            ASTRAFLOW_RANK_CONTROL=f"{host}:{port}",
            ASTRAFLOW_RANK_TOKEN=token,
            MASTER_ADDR=allocation.master_addr,
            MASTER_PORT=str(free_port(allocation.master_addr)),
        )
        self.command = srun_command(allocation, launch.world, launch.log_dir, sys.executable, RANK_MODULE)
        self.proc: subprocess.Popen | None = None
        try:
            with open(self.srun_log, "ab") as fh:
                self.proc = subprocess.Popen(self.command, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, cwd=launch.workdir)
            self.conns, hellos = accept_ranks(server, token.encode(), launch.world,
                                              time.monotonic() + start_timeout_s, self._check_running)
        except BaseException:
            self.kill()
            raise
        finally:
            server.close()
        self.where = [{k: h.get(k) for k in ("node", "host", "pid")} for h in hellos]
        self.step = hellos[0].get("step")

    def _check_running(self) -> None:
        if self.proc.poll() is not None:
            said = self.srun_log.read_text(errors="replace").splitlines()[-10:] if self.srun_log.exists() else []
            raise RankError(f"srun exited ({self.proc.returncode}) before every rank connected; see {self.srun_log} "
                            "and the rank logs. srun said:\n" + "\n".join(said))

    def exited(self) -> list[int]:
        """Every rank once the step has ended (srun ends with the step; with
        ``--kill-on-bad-exit`` one rank failing ends all of them)."""
        return list(range(self.world)) if self.proc.poll() is not None else []

    def exit_codes(self, ranks: list[int]) -> dict[int, int | None]:
        """Not known rank by rank: srun's own status is in its log."""
        return {}

    def wait(self, timeout_s: float) -> None:
        self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        """End the step: SIGTERM to srun (which signals every task), then, if it lingers,
        ``scancel`` of the step and SIGKILL to srun; close the channels."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                if self.step:
                    cancel_step(self.step)
                self.proc.kill()
                self.proc.wait(timeout=30)
        for c in self.conns:
            c.close()
        self.conns = []


def accept_ranks(server: socket.socket, token: bytes, world: int, deadline: float,
                 check: Callable[[], None]) -> tuple[list[Connection], list[dict]]:
    """Every rank's authenticated connection and hello, in rank order, from ``server``'s
    connections (``check`` raises when the ranks can no longer come). Each handshake runs in its
    own thread, so a peer that connects and says nothing holds up nothing; a peer without the
    token, or naming a rank that is taken or out of range, is dropped."""
    done: queue.Queue = queue.Queue()
    pending: list[socket.socket] = []
    by_rank: dict[int, tuple[Connection, dict]] = {}
    server.settimeout(0.2)
    try:
        while len(by_rank) < world:
            check()
            if time.monotonic() > deadline:
                raise RankError(f"ranks {sorted(set(range(world)) - set(by_rank))} did not connect to the backend "
                                "within the start deadline; see the rank logs")
            try:
                sock, _ = server.accept()
            except TimeoutError:
                sock = None
            if sock is not None:
                pending.append(sock)
                threading.Thread(target=_handshake, args=(sock, token, done), daemon=True).start()
            while not done.empty():
                sock, conn, hello = done.get()
                pending.remove(sock)  # authenticated: its own descriptor, not to be shut down below
                sock.close()
                rank = hello.get("rank")
                if type(rank) is not int or not 0 <= rank < world or rank in by_rank:
                    conn.close()
                    continue
                by_rank[rank] = (conn, hello)
    except BaseException:
        for conn, _ in by_rank.values():
            conn.close()
        raise
    finally:
        for sock in pending:  # wakes a handshake still waiting on a silent peer, ends a failed one
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
    return [by_rank[r][0] for r in range(world)], [by_rank[r][1] for r in range(world)]


def _handshake(sock: socket.socket, token: bytes, done: queue.Queue) -> None:
    """Authenticate one connection both ways, then read the rank's hello; a failure closes it."""
    try:
        sock.settimeout(None)
        conn = Connection(os.dup(sock.fileno()))
    except OSError:
        return
    try:
        deliver_challenge(conn, token)
        answer_challenge(conn, token)
        hello = json.loads(conn.recv_bytes(_HELLO_MAX))
        if not isinstance(hello, dict):
            raise ValueError("hello is not an object")
    except Exception:  # a wrong token, a peer that hung up, garbage
        conn.close()
        return
    done.put((sock, conn, hello))


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the OS picks it; rank 0 binds it moments later)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_ranks(launcher: str, launch: RankLaunch, start_timeout_s: float,
                fork: bool = True) -> LocalRanks | SrunRanks:
    """``LocalRanks`` (forked where ``fork``) or ``SrunRanks`` for ``launcher`` (``auto``: srun
    inside a Slurm job that spans more than one node, else local)."""
    if launcher == "auto":
        launcher = "srun" if Allocation.spans_nodes() else "local"
    if launcher == "local":
        return LocalRanks(launch, start_timeout_s, fork)
    return SrunRanks(launch, Allocation.from_env(launch.world), start_timeout_s)


# -- the rank's side ---------------------------------------------------------------------------
def rank_spec() -> dict:
    """This rank's ``DistSpec`` fields. Under srun the rank is Slurm's ``SLURM_PROCID``, also
    exported as ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` for ``env://`` and the GPU choice."""
    spec = json.loads(os.environ["ASTRAFLOW_RANK_SPEC"])
    if "rank" not in spec:
        rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
        if world != spec["world_size"]:
            raise ValueError(f"srun started {world} tasks but the backend expects {spec['world_size']} ranks")
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=os.environ["SLURM_LOCALID"])
        spec["rank"] = rank
    return spec


def rank_channel(rank: int) -> Connection:
    """The channel to the backend: a connection to its Unix socket (``unix:PATH``, relative to
    the rank's working directory) or, under srun, over TCP (``HOST:PORT``), authenticated with
    the launch's token, then a hello naming this rank."""
    control = os.environ["ASTRAFLOW_RANK_CONTROL"]
    # popped: nothing this rank starts (checkpoint writer processes) needs the token
    token = os.environ.pop("ASTRAFLOW_RANK_TOKEN").encode()
    if control.startswith("unix:"):
        conn = Client(control[len("unix:"):], family="AF_UNIX", authkey=token)
    else:
        host, _, port = control.rpartition(":")
        conn = Client((host, int(port)), authkey=token)
    step = f"{os.environ.get('SLURM_JOB_ID', '')}.{os.environ.get('SLURM_STEP_ID', '')}"
    conn.send_bytes(json.dumps({"rank": rank, "step": step, "host": socket.gethostname(),
                                "node": os.environ.get("SLURMD_NODENAME"), "pid": os.getpid()}).encode())
    return conn
