"""Runtime room: bring-up and placement. Starts the run's Dask scheduler and connects to it,
builds actors on workers chosen **by name** (the name says role, partition, region, hardware),
and waits for workers and actors with deadlines that name what is still missing.

What each actor is built with (`data_layer_kwargs`, `trainer_kwargs`, `node_kwargs`) is a pure
function of the config, the run paths and the partition of its worker: each component receives
only its own config section, with the partition's settings merged over it
(`astraflow.partition_settings`).
"""

from __future__ import annotations

import logging
import socket
import sys
import time
import uuid
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from distributed import Client

from astraflow.codeversion import code_fingerprint, differences
from astraflow.partition_settings import effective_rollout, effective_trainer
from astraflow.rollout.identity import NodeIdentity
from astraflow.runtime.cluster import SchedulerProcess, connected_workers, export_repo_path, last_error_line
from astraflow.runtime.construct import by_name, class_path, construct
from astraflow.runtime.monitoring import write_orchestrator_info
from astraflow.runtime.security import client_security, dashboard_token, run_tls
from astraflow.runtime.workers import LostBeforeReady, RunFailed, WorkerUnusable
from schedulers import Partition, TLSFiles
from schedulers.base import ACTIVE_STATES
from schedulers.local import job_lines
from schedulers.command import is_loopback
from storage.atomic import write_atomically
from storage.paths import RunPaths

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig, RunConfig
    from astraflow.runtime.progress import Progress
    from astraflow.training.config import PolicyConfig

#: job states after which a worker that has not joined never will (UNKNOWN is not one)
ENDED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED"}) - ACTIVE_STATES

#: seconds between ``wait_all``'s checks that the worker of an actor it waits for is still there
LOST_CHECK_S = 2.0



class SchedulerLost(RunFailed):
    """The run's Dask scheduler process is gone: nothing can go on, and everything the run
    committed resumes; ``astraflow run`` exits 75 on it, on which the head job requeues itself."""

class Placement:
    """The Dask scheduler process and client of a run, and actors placed on named workers."""

    def __init__(self, paths: RunPaths, cluster: ClusterConfig, progress: Progress, data_read_s: float = 0.0):
        self.paths = paths
        self.cluster = cluster
        self.progress = progress
        #: seconds ``launch`` took to read the workload's data: a data layer reads it again as it is
        #: constructed, so its placement deadline is longer by twice that (``wait_all(reads_data=True)``)
        self.data_read_s = data_read_s
        self.scheduler_proc: SchedulerProcess | None = None
        self.client: Client | None = None
        self.dashboard: str | None = None
        #: the run's TLS certificates (None: TLS turned off); workers are started with them
        self.tls: TLSFiles | None = None
        #: this process's code (``codeversion``), taken when the run starts
        self.code = code_fingerprint()
        #: the worker addresses whose code was found the same
        self._same_code: set[str] = set()
        #: fingerprints asked of workers ahead of their check (``ask_code``), by worker name and
        #: address (a worker that left unchecked and another at its address are not confused)
        self._asked: dict[tuple[str, str], dict[str, Any]] = {}
        #: the worker (name, address) each actor was placed on, by its task's key: ``wait_all``
        #: gives up on one whose worker left (Dask would keep the pinned task waiting for it)
        self._pinned: dict[str, tuple[str, str]] = {}

    def start(self) -> None:
        """Start the scheduler (workers started later import AstraFlow from this checkout),
        connect, and publish who runs the orchestrator in ``control/orchestrator.json``."""
        export_repo_path()
        cc = self.cluster
        self.tls = run_tls(self.paths, cc.tls)
        exposed = not is_loopback(cc.dashboard_host)  # then HTTPS too (the config checked TLS is on)
        token_file = dashboard_token(self.paths)  # other users of a shared node reach its loopback as well
        self.scheduler_proc = SchedulerProcess(self.paths, cc.dashboard_host, cc.dashboard_port,
                                               host=cc.scheduler_host, interface=cc.scheduler_interface, tls=self.tls,
                                               dashboard_token_file=token_file, dashboard_https=exposed)
        with self.progress.waiting("starting the Dask scheduler"):
            try:
                address = self.scheduler_proc.start()
            except (RuntimeError, TimeoutError) as err:  # its own line says why (a host, a port, an interface)
                raise RunFailed(str(err)) from None
        self.client = Client(address, timeout=30, security=client_security(self.tls))
        dash = self.client.scheduler_info().get("services", {}).get("dashboard")
        host = cc.dashboard_host if cc.dashboard_host not in ("0.0.0.0", "::") else socket.getfqdn()
        base = f"{'https' if exposed else 'http'}://{host}:{dash}" if dash else None
        self.dashboard = f"{base}/status" if base else None
        self.progress.note(f"Dask scheduler {address}; dashboard {self.dashboard}")
        if dash and cc.dashboard_port and dash != cc.dashboard_port:  # Dask moved it: another process has it
            self.progress.note(f"cluster.dashboard_port {cc.dashboard_port} is taken on this machine, so the dashboard "
                               f"is on port {dash}: an SSH tunnel to port {cc.dashboard_port} reaches another run or "
                               "another user's program, not this run (never send it the run's token); tunnel to "
                               f"port {dash}, or set cluster.dashboard_port to a free port (0: any)")
        if base:
            url = f"{base}/astraflow?token={token_file.read_text().strip()}"
            write_atomically(token_file.with_name("dashboard.url"), url + "\n")
            how = "HTTPS with the run's certificate, and the run's token" if exposed else "the run's token"
            # a terminal shows the token; a log (a Slurm job's, often readable by others) does not
            shown = url if sys.stdout.isatty() else f"{base}/astraflow"
            self.progress.note(f"AstraFlow page {shown} (bound to {cc.dashboard_host}: {how}; the address with the "
                               f"token is in {token_file.with_name('dashboard.url')}, readable by you only)")
        write_orchestrator_info(self.paths, self.dashboard, address)

    def scheduler_gone(self) -> str | None:
        """Why the run's Dask scheduler process is gone (the reason a run then ends with), or None
        while it runs: every component reaches the others through it, so the run cannot go on."""
        proc = self.scheduler_proc.proc if self.scheduler_proc is not None else None
        if proc is None or proc.poll() is None:
            return None
        code = proc.returncode
        # its client's reconnect attempts would put Dask's own error lines on the terminal
        logging.getLogger("distributed.client").setLevel(logging.CRITICAL)
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return (f"the Dask scheduler {how} (its log: {self.paths.log('scheduler')}), and the run cannot go on "
                "without it: run `astraflow run` on the run directory again to resume it")

    def scheduler_contact(self, part: Partition) -> str:
        """How ``part``'s workers find the scheduler: the scheduler file for Slurm workers, read when
        they start (a job that waited in the queue still finds it); its address for local ones."""
        if part.scheduler == "slurm":
            return str(self.paths.scheduler_file.resolve())
        return self.client.scheduler.address  # type: ignore[union-attr]

    def joined(self) -> dict[str, str]:
        """``{worker name: address}`` of the workers connected now."""
        info = connected_workers(self.client)
        return {w["name"]: addr for addr, w in info.items()}

    def submit_actor(self, cls, worker: str, **kwargs):
        """Construct ``cls`` as an actor pinned to the worker named ``worker``; returns the
        future of the handle (the caller waits with the placement deadline). ``RunFailed`` when
        the worker runs other code than this process (`check_code`), or has left meanwhile."""
        address = self.joined().get(worker)
        if address is None:  # seen joined a moment ago, gone since (killed, out of memory)
            raise WorkerUnusable(f"worker {worker} left the Dask scheduler before its actor could be placed there")
        self.check_code(worker, address)
        where = class_path(cls)  # the class by name: the scheduler need not import it (`construct`)
        args = (construct, where) if by_name(cls) else (cls,)  # else pickled by value, as Dask does
        key = f"{cls.__name__}-{uuid.uuid4()}"
        self._pinned[key] = (worker, address)
        return self.client.submit(  # type: ignore[union-attr]
            *args, key=key, actor=True, workers=[address], allow_other_workers=False, **kwargs
        )

    def check_code(self, worker: str, address: str) -> None:
        """``RunFailed`` naming what differs when the worker at ``address`` runs other AstraFlow
        code, Python or libraries than the run (asked once per worker)."""
        if address in self._same_code:
            return
        try:
            theirs = self._asked.pop((worker, address), None) or \
                self.client.run(code_fingerprint, workers=[address])[address]  # type: ignore[union-attr]
        except Exception as err:  # it left meanwhile, or its check failed: nothing is placed there
            raise WorkerUnusable(f"worker {worker}: its code could not be checked ({type(err).__name__}: "
                                 f"{err})") from err
        if diff := differences(self.code, theirs):
            raise WorkerUnusable(
                f"worker {worker} runs other code than this run ({'; '.join(diff)}): the installed AstraFlow "
                "changed under the live run, or the worker's job uses another environment. Stop the run, make "
                "every partition's jobs use the run's installation, then run `astraflow run` again on this run "
                "directory to resume it (docs/upgrading.md)")
        self._same_code.add(address)

    def ask_code(self, workers: dict[str, str]) -> None:
        """Ask ``workers`` (name -> address) for their code's fingerprint in one call, which they
        answer side by side (each takes a while to hash its sources), instead of one after the
        other as each is checked; ``check_code`` compares what came back. A worker that did not
        answer is asked again by ``check_code``, which names why."""
        todo = {a: n for n, a in workers.items() if a not in self._same_code and (n, a) not in self._asked}
        if not todo:
            return
        try:
            got = self.client.run(code_fingerprint, workers=list(todo), on_error="return")  # type: ignore[union-attr]
        except Exception:  # the check of each, later, says what is wrong
            return
        self._asked.update({(todo[a], a): fp for a, fp in got.items() if a in todo and isinstance(fp, dict)})

    def wait_all(self, what: str, futures: dict[str, Any], reads_data: bool = False) -> dict[str, Any]:
        """Wait for every future with the placement deadline, naming what is still missing;
        ``reads_data``: an actor that reads the workload's data as it starts (the data layer)."""
        timeout = self.cluster.placement_timeout_s + (2 * self.data_read_s if reads_data else 0.0)
        deadline = time.time() + timeout
        out = {}
        for key, fut in futures.items():
            self.progress.detail(f"{len(out)}/{len(futures)} ready; waiting for {key}")
            while key not in out:
                try:
                    out[key] = fut.result(timeout=min(max(deadline - time.time(), 0.1), LOST_CHECK_S))
                except TimeoutError:
                    if time.time() >= deadline:
                        missing = [k for k in futures if k not in out]
                        raise RunFailed(
                            f"{what} did not finish within {timeout:.0f}s (cluster.placement_timeout_s"
                            + (f" and twice the {self.data_read_s:.0f}s the data took to read" if reads_data else "")
                            + f") for {missing}; see the worker logs in {self.paths.jobs}"
                        ) from None
                    self._check_not_lost(what, key, fut)
        return out

    def _check_not_lost(self, what: str, key: str, fut: Any) -> None:
        """``LostBeforeReady`` when the worker ``fut``'s actor was placed on left the cluster: its
        task would wait for it until the placement deadline."""
        pinned = self._pinned.get(getattr(fut, "key", None))
        if pinned is None or self.joined().get(pinned[0]) == pinned[1]:
            return
        raise LostBeforeReady(f"{what}: worker {pinned[0]} was lost before {key} was ready (killed, out of memory or "
                              f"its job ended; its log is in {self.paths.jobs}); `astraflow run` on the run directory "
                              "resumes")

    def wait_workers(self, names: list[str], job_states: Callable[[], dict[str, str]],
                     logs: Callable[[str], Path | None] = lambda name: None, hint: str = "") -> None:
        """Wait until every named worker joined (deadline ``cluster.worker_start_timeout_s``),
        showing which have not and the state of their jobs (``job_states``: worker name ->
        state, asked every 5 s: PENDING in a Slurm queue, ...); then asks them for their code
        (``ask_code``). Rollout workers whose jobs wait in the queue do not hold the run back
        once every other worker and one rollout worker joined: they join when Slurm starts them,
        as a refill's do. ``hint``: a likely cause, said with a failure to join a running job or
        with a job that ended failing to connect."""
        timeout = self.cluster.worker_start_timeout_s
        deadline = time.time() + timeout
        states: dict[str, str] = {}
        ended_before: set[str] = set()
        next_poll = 0.0
        while True:
            joined = self.joined()
            missing = [n for n in names if n not in joined]
            rollout = [n for n in names if n.startswith("rollout-")]
            queued = [n for n in missing if n in rollout and states.get(n) == "PENDING"]
            if not missing or (len(queued) == len(missing) and any(n in joined for n in rollout)):
                if queued:
                    self.progress.note(f"starting without {len(queued)} rollout worker(s) whose jobs wait in the "
                                       f"queue ({', '.join(queued)}): they join when Slurm starts them")
                self.ask_code({n: joined[n] for n in names if n in joined})  # all at once, before each is placed on
                return
            if time.time() >= next_poll:
                next_poll = time.time() + 5.0
                states = job_states()
                # a job that ended without its worker joining (seen so twice: not a requeue) never will
                ended = {n for n in missing if states.get(n, "PENDING") in ENDED_STATES}
                if ended & ended_before:
                    said = self._never_joined(sorted(ended & ended_before), states, logs)
                    # the hint (how workers reach the scheduler) only where a worker failed to connect,
                    # not where its job failed before (a setup line, a missing module)
                    raise RunFailed(said + (f"; {hint}" if hint and "connect" in said.lower() else ""))
                ended_before = ended
            shown = ", ".join(f"{n} ({states.get(n, '?')})" for n in missing[:3])
            self.progress.detail(f"{len(names) - len(missing)}/{len(names)} joined; not yet {shown}"
                                 + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))
            if time.time() > deadline:  # the hint (how workers reach the scheduler) is for jobs that run
                running = hint and any(states.get(n) == "RUNNING" for n in missing)
                raise RunFailed(f"workers did not join within {timeout:.0f}s (cluster.worker_start_timeout_s): "
                                + ", ".join(f"{n} ({states.get(n, '?')})" for n in missing)
                                + f"; see {self.paths.jobs}/*.log" + (f"; {hint}" if running else ""))
            time.sleep(0.2)


    def _never_joined(self, names: list[str], states: dict[str, str], logs: Callable[[str], Path | None]) -> str:
        """Why the run stops: workers whose jobs ended before they joined, with what their logs
        say last since the job started (a bad setting, a missing module, a wrong Python),
        workers that say the same named together."""
        by_error: dict[str, list[str]] = {}
        for name in names:
            log_file = logs(name)
            lines = job_lines(log_file) if log_file is not None else []
            by_error.setdefault(last_error_line(lines)[:300], []).append(f"{name} ({states.get(name)})")
        said = "; ".join(f"{', '.join(ws)}: {error}" for error, ws in list(by_error.items())[:3])
        return f"worker job(s) ended before joining the Dask scheduler: {said}; see {self.paths.jobs}/*.log"


def loopback_hint(cc: ClusterConfig, partitions: Iterable[Partition]) -> str:
    """What to say where Slurm partitions' workers must join a scheduler that listens on loopback
    (the default): only those Slurm places on the head's own host can reach it. ``""`` otherwise."""
    slurm = sorted(p.name for p in partitions if p.scheduler == "slurm")
    if not slurm or cc.scheduler_interface is not None or not is_loopback(cc.scheduler_host):
        return ""
    return (f"the Dask scheduler listens on {cc.scheduler_host} (cluster.scheduler_host), which the workers of "
            f"Slurm partition(s) {', '.join(slurm)} reach only from this host: set cluster.scheduler_interface "
            "(e.g. ib0) or cluster.scheduler_host to the head node's address")


# -- what each actor is built with ----------------------------------------------------------------

def store_url(cfg: RunConfig, paths: RunPaths) -> str:
    return cfg.storage.trajectories or str(paths.trajectories)


def data_layer_kwargs(cfg: RunConfig, paths: RunPaths, keep_leases: bool = False) -> dict[str, Any]:
    """``keep_leases``: a data layer re-placed while the run's RaaS nodes still run."""
    durable = cfg.dataflow.durable
    return dict(
        dataflow=cfg.dataflow, workload=cfg.workload, policies=[p.name for p in cfg.policies],
        store_url=store_url(cfg, paths), metrics_path=str(paths.metrics), max_steps=cfg.run.max_steps,
        seed=cfg.run.seed, gated=cfg.run.mode == "sync", state_path=str(paths.dataflow_state),
        snapshot_path=str(paths.dataflow_snapshot) if durable else None,
        journal_path=str(paths.ledger_journal) if durable else None, keep_leases=keep_leases,
        keep_trajectories=cfg.storage.keep_trajectories,
    )


def trainer_kwargs(cfg: RunConfig, paths: RunPaths, index: int, pol: PolicyConfig, data_layer: Any,
                   part: Partition | None = None) -> dict[str, Any]:
    """The trainer of policy number `index` (its seed is offset by the index) on a worker of `part`."""
    return dict(
        policy=pol.name, cfg=effective_trainer(pol.trainer, part).for_deltas(cfg.storage.deltas),
        model_path=str(pol.model),
        weights_root=str(paths.weights), keep_versions=cfg.storage.keep_versions,
        data_layer=data_layer, max_steps=cfg.run.max_steps, seed=cfg.run.seed + index,
        write_deltas=cfg.storage.deltas, optimizer_path=str(paths.optimizer_state(pol.name)),
        store_url=store_url(cfg, paths),  # it reads the rows of its batches there, as the nodes write them
        log_dir=str(paths.logs / f"trainer-{pol.name}"),  # its backend's own processes' logs (Megatron ranks)
    )


def node_seed(run_seed: int, name: str) -> int:
    """A RaaS node's sampling seed: the run's, mixed with the node's name, so that nodes never
    draw the same random stream (two nodes decoding one prompt would sample the same answers)."""
    return (run_seed * 1_000_003 + zlib.crc32(name.encode())) % 2**31


def node_kwargs(cfg: RunConfig, paths: RunPaths, name: str, part: Partition, data_layer: Any) -> dict[str, Any]:
    """The RaaS node on worker `name` of partition `part`."""
    return dict(
        identity=NodeIdentity(name=name, partition=part.name, region=part.region, hardware=part.hardware),
        rollout=effective_rollout(cfg.rollout, part),
        gpus=part.gpus_per_node,
        models={p.name: str(p.model) for p in cfg.policies},
        workload_name=cfg.workload.name,
        workload_params=cfg.workload.params,
        workload_seed=cfg.workload.seed,
        workflow=cfg.workload.workflow,
        sampling=cfg.workload.sampling,
        store_url=store_url(cfg, paths),
        weights_root=str(paths.weights),
        data_layer=data_layer,
        seed=node_seed(cfg.run.seed, name),
        run_seed=cfg.run.seed,
        use_deltas=cfg.storage.deltas,
        sandbox=cfg.sandbox,
    )
