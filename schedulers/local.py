"""Workers as local subprocesses: the embedded default (a laptop, CI, no Slurm).

Each worker is `worker_command(...)` started in its own process group (so `cancel` also stops
anything the worker spawned), its stdout/stderr going to ``<log_dir>/<worker name>.log``: forked
from a fork server (`start_fork_server`: one process imports the workers' code once for all of
them, ``schedulers.forkserver``) where one was given, else with `subprocess.Popen`. The job id
is ``local-<pid>``. Only processes this object started are ever signalled, and only by their
own PID/process group, with one exception: `cancel_previous` stops the workers a previous
incarnation of the run started, and only those whose pid still belongs to that very worker (its
recorded `process_identity` and command line).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from schedulers.base import JobRef, JobStatus, UnknownJobError
from schedulers.command import TLSFiles, partition_worker_command, quiet_dask_env, worker_env
from schedulers.forkserver import FORK_SERVER_MARK, NOT_READY, ForkedProcess, ForkServer, ForkServerError
from schedulers.procs import die_with_parent, process_argv, process_identity, stop_env, stop_signal
from schedulers.partition import Partition, worker_name


logger = logging.getLogger(__name__)


@dataclass
class _Proc:
    popen: subprocess.Popen | ForkedProcess
    partition: str
    name: str
    log: Path
    cancelled: bool = False


class LocalScheduler:
    """`Scheduler` backend that runs each worker as a subprocess of this process.

    `log_dir`: where ``<worker>.log`` files go. `host`: address workers listen on (loopback by
    default: local traffic stays on this machine); `interface`: the network interface they
    listen on instead (a run whose other workers are on other hosts must reach them).
    `term_timeout`: seconds `cancel` waits after SIGTERM before it sends SIGKILL. `tls`: the
    run's certificates, for a ``tls://`` scheduler. `fork_server` (`start_fork_server`, closed
    with this object): where workers are forked from; one it cannot stand in for (another
    environment, the server gone) starts as a fresh process.
    """

    kind = "local"
    supports_gres = False

    def __init__(
        self,
        log_dir: str | Path,
        *,
        python: str = sys.executable,
        host: str | None = "127.0.0.1",
        interface: str | None = None,
        death_timeout: float = 60,
        term_timeout: float = 10.0,
        tls: TLSFiles | None = None,
        fork_server: ForkServer | None = None,
    ):
        self.log_dir = Path(log_dir)
        self._server = fork_server
        self._forking = fork_server is not None  # False once the server failed a start
        self.python = python
        self.host = None if interface else host
        self.interface = interface
        self.death_timeout = death_timeout
        self.term_timeout = term_timeout
        self.tls = tls
        self._procs: dict[str, _Proc] = {}

    def submit(self, partition: Partition, scheduler_address: str, count: int, start_index: int = 0) -> list[JobRef]:
        if partition.scheduler != "local":
            raise ValueError(
                f"partition {partition.name!r} has scheduler {partition.scheduler!r}: submit it to that backend "
                "or set scheduler: local"
            )
        if count < 0:
            raise ValueError(f"count is {count}: use 0 or more")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        refs: list[JobRef] = []
        for index in range(start_index, start_index + count):
            try:
                refs.append(self._start(partition, scheduler_address, worker_name(partition, index)))
            except OSError as err:  # all or none: the workers this call started go too
                self.cancel([r.job_id for r in refs])
                undone = f", and stopped the {len(refs)} it had started" if refs else ""
                raise OSError(f"starting local worker {worker_name(partition, index)} failed: "
                              f"{type(err).__name__}: {err}{undone}") from err
        return refs

    def _start(self, partition: Partition, scheduler_address: str, name: str) -> JobRef:
        cmd = partition_worker_command(
            partition,
            scheduler_address,
            name,
            python=self.python,
            host=self.host,
            interface=self.interface,
            death_timeout=self.death_timeout,
            tls=self.tls,
        )
        log = self.log_dir / f"{name}.log"
        env = {**os.environ, **worker_env(partition, name), **stop_env()}
        with open(log, "ab") as out:
            # the log keeps every start of this worker name: where this one begins
            out.write(f"{JOB_START_MARK} {name} {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
            out.flush()
            popen, why = self._forked(cmd, env, log)
            if popen is None:
                if why:
                    out.write(f"started as a fresh process, not forked: {why}\n".encode())
                    out.flush()
                popen = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,  # own process group: cancel reaches the worker's children too
                    preexec_fn=die_with_parent,  # no orphaned worker if this process dies
                )
        job_id = f"local-{popen.pid}"
        self._procs[job_id] = _Proc(popen, partition.name, name, log)
        return JobRef(job_id, partition.name, name, self.kind, log, identity=process_identity(popen.pid))

    def _forked(self, cmd: list[str], env: dict[str, str], log: Path) -> tuple[ForkedProcess | None, str | None]:
        """The worker forked from the fork server, or None and why not (None: there is no server).
        A server that failed is not asked again; it is closed at once only where no worker
        forked from it runs (they would die with it), else with this object."""
        if self._server is None or not self._forking:
            return None, None
        why = self._server.misfit(cmd, env)
        if why == NOT_READY:  # its imports outlasted the wait: the next workers need not wait on it again
            self._forking = False
        if why is not None:
            return None, why
        try:
            return self._server.start(cmd, env, log), None
        except ForkServerError as err:
            logger.warning("local workers start as fresh processes from now on: %s", err)
            self._forking = False
            if not any(isinstance(p.popen, ForkedProcess) and p.popen.poll() is None for p in self._procs.values()):
                self._server.close()
            return None, str(err)

    def cancel(self, job_ids: Iterable[str], wait: bool = False) -> None:
        """Always waits: SIGTERM (SIGINT inside a Slurm job: `stop_signal`), then SIGKILL after
        ``term_timeout``, each process reaped."""
        ids = list(job_ids)
        unknown = [j for j in ids if j not in self._procs]
        procs = [self._procs[j] for j in ids if j in self._procs]
        for p in procs:
            if p.popen.poll() is None:
                p.cancelled = True
                self._signal(p, stop_signal())
        deadline = time.monotonic() + self.term_timeout
        for p in procs:
            if not p.cancelled:
                continue
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(p, signal.SIGKILL)
                p.popen.wait(timeout=self.term_timeout)
        for p in procs:  # what the worker spawned (engines, ranks) may outlive it: its group, until the deadline
            if p.cancelled:
                _end_group(p.popen.pid, deadline)
        if unknown:
            raise UnknownJobError(unknown, self.kind)

    def jobs(self) -> list[JobStatus]:
        out = []
        for job_id, p in self._procs.items():
            rc = p.popen.poll()
            if rc is None:
                state, reason = "RUNNING", None
            elif p.cancelled:
                state, reason = "CANCELLED", f"cancelled (exit code {rc})"
            elif rc == 0:
                state, reason = "COMPLETED", "exit code 0"
            else:
                state = "FAILED"
                reason = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
                reason += f"; see {p.log}"
            out.append(JobStatus(job_id, p.partition, p.name, state, reason, None, "localhost" if rc is None else None))
        return out

    def cancel_previous(self, records: Sequence[JobRef]) -> list[JobStatus]:
        """Stop the workers of `records` (a previous incarnation's) that still run: SIGINT to the
        worker's process group (a Dask process takes it whether or not it was started to ignore
        SIGTERM, which depended on where that incarnation ran), SIGKILL after `term_timeout`. A
        record's pid is signalled
        only while it is verifiably that worker: the same `process_identity` (so not a pid the
        kernel has given to another process since, nor one on another host) and a command line
        naming the worker (``--name <worker>``). The check and the signal are a few
        microseconds apart, and a reused pid would also have to lead a process group."""
        victims = [(ref, int(ref.job_id.removeprefix("local-"))) for ref in records
                   if ref.kind == self.kind and ref.identity and ref.job_id.removeprefix("local-").isdigit()]
        victims = [(ref, pid) for ref, pid in victims if _is_worker(pid, ref)]
        for ref, pid in victims:
            _killpg(pid, signal.SIGINT)
        deadline = time.monotonic() + self.term_timeout
        while any(_is_worker(pid, ref) for ref, pid in victims) and time.monotonic() < deadline:
            time.sleep(0.05)
        for ref, pid in victims:
            if _is_worker(pid, ref):
                _killpg(pid, signal.SIGKILL)
        return [JobStatus(ref.job_id, ref.partition, ref.worker_name, "RUNNING", "left by a previous incarnation",
                          None, ref.identity.split("/", 1)[0] if ref.identity else None) for ref, _ in victims]

    def close(self) -> None:
        """Cancel every worker still running (call at shutdown; also on context exit)."""
        self.cancel([j for j, p in self._procs.items() if p.popen.poll() is None])
        if self._server is not None:
            self._server.close()

    def __enter__(self) -> "LocalScheduler":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _signal(p: _Proc, sig: signal.Signals) -> None:
        # The group id is the worker's own pid (start_new_session); signal only while it is unreaped,
        # so the id cannot belong to another process.
        if p.popen.poll() is None:
            try:
                os.killpg(p.popen.pid, sig)
            except ProcessLookupError:  # the leader exited between poll() and killpg(): nothing left to stop
                pass


def start_fork_server(log_dir: str | Path, modules: Sequence[str], python: str = sys.executable) -> ForkServer:
    """A fork server for `LocalScheduler`'s workers, importing `modules` (it starts importing at
    once: start it early, and the imports overlap what this process does meanwhile). Its
    environment is what a worker of a partition without ``env`` gets, less the worker's name."""
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **quiet_dask_env(os.environ), **stop_env()}
    return ForkServer(python, modules, env, Path(log_dir) / "forkserver.log")


#: the line a local worker's log gets before each start of the worker (``job_lines``)
JOB_START_MARK = "==== astraflow: starting worker"


def job_lines(log: Path) -> list[str]:
    """The non-empty lines of a worker's log since its latest start (a local worker's log holds
    every start of its name; a Slurm job's is its own)."""
    try:
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return []
    starts = [i for i, x in enumerate(lines) if x.startswith(JOB_START_MARK)]
    return lines[starts[-1] + 1:] if starts else lines


def _end_group(pgid: int, deadline: float) -> None:
    """Wait until the process group ``pgid`` of a reaped worker has no live member, at most until
    ``deadline``, then SIGKILL what is left. A group of zombies only is gone: nothing in it runs,
    and an orphan's zombie (a multiprocessing resource tracker, say) waits for PID 1 to reap it,
    which in a container without an init never comes. Safe after the leader is reaped: the
    kernel does not give a pid to a new process while a process group of that id has members."""
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # gone meanwhile, or not ours
            pass


def _group_alive(pgid: int) -> bool:
    """Whether the process group ``pgid`` has a member this process may signal that is not a
    zombie (where /proc cannot tell zombies apart, any member it may signal)."""
    try:
        os.killpg(pgid, 0)  # the cheap answer first: nobody left
    except ProcessLookupError:
        return False
    except PermissionError:  # not ours: nothing to stop here
        return False
    # zombies only: on two scans, so that a child forked while the first one ran is seen
    return not (_live_members(pgid) is False and _live_members(pgid) is False)


def _live_members(pgid: int) -> bool | None:
    """Whether /proc lists a process of group ``pgid`` that is neither a zombie nor dead; None
    where /proc cannot be read or is not this process's (another pid namespace's)."""
    try:
        pids = [d for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return None
    if str(os.getpid()) not in pids:
        return None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # ended since the listing
            continue
        fields = stat.rsplit(b")", 1)[-1].split()  # after the command name, which may hold anything
        if len(fields) > 2 and fields[2] == str(pgid).encode() and fields[0] not in (b"Z", b"X"):
            return True
    return False


def _is_worker(pid: int, ref: JobRef) -> bool:
    """Whether `pid` is still the worker `ref` recorded: same identity, and a command line naming
    it (``--name <worker>``) or that of a fork server's child (which has the server's)."""
    if ref.identity is None or process_identity(pid) != ref.identity:
        return False
    argv = process_argv(pid)
    return (any(a == "--name" and b == ref.worker_name for a, b in zip(argv, argv[1:]))
            or any(FORK_SERVER_MARK in a for a in argv))


def _killpg(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)  # the worker leads its own group (start_new_session)
    except ProcessLookupError:  # it ended since the check: nothing left to stop
        pass
