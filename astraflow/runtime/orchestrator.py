"""The orchestrator: brings up the Dask scheduler, reconciles partitions with worker jobs,
places components on workers by name, watches the run, and stops everything it started.

It owns no training logic. Each tick of its loop it:

1. reads the *desired* partitions (the config, plus ``astraflow partitions add/remove`` written
   to ``<run>/control/partitions.json``) and submits or cancels worker jobs to match;
2. places a RaaS actor on every rollout worker that joined and has none (the node catches up to
   the latest weights before leasing), and tells the data layer about workers that vanished
   (their leases are requeued at once instead of waiting for expiry);
3. shows progress, and ends the run when every trainer took its steps and the last evaluation
   finished (or on Ctrl-C / a component error / the run deadline).

Rollout workers move through a small state machine, advanced one step per tick so that the
loop never blocks on a slow worker (a Slurm job in the queue, a model loading, a drain)::

    submitted --joined--> placing --actor built--> starting --caught up--> serving
        any phase --remove--> draining (node stops leasing, finishes and writes what it holds)
                  --> gone (job cancelled; leases still held are requeued by ``node_gone``)
        any phase --job ended / worker left--> gone (leases requeued, the partition refilled)

Named overlap, *drain vs. lease expiry*: a draining node keeps heartbeating, so its leases stay
valid until it completes them; only after its ``stop`` returns (or ``cluster.drain_timeout_s``
passes) is the job cancelled and whatever it still holds requeued. A task therefore ends once
either way: completed by the draining node, or requeued and completed by another.

Shutdown always runs, in this order: RaaS nodes drain and flush (nothing written is lost),
trainers stop, the data layer ends every open task in the ledger and closes ``metrics.jsonl``,
worker jobs are cancelled by id, the scheduler process is stopped by pid.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distributed import Client

from astraflow.config import RunConfig, dump_config
from astraflow.dataflow.layer import DataLayer
from astraflow.rollout.node import NodeIdentity, RaaSNode
from astraflow.runtime.cluster import SchedulerProcess, connected_workers, repo_root
from astraflow.runtime.control import (
    read_desired_file,
    write_desired,
    write_json_atomic,
    write_orchestrator_info,
)
from astraflow.runtime.progress import Progress
from astraflow.training.trainer import Trainer
from schedulers import JobRef, JobStatus, Partition, make_scheduler, parse_worker_name
from schedulers.slurm import SlurmCommandError
from storage.paths import RunPaths

log = logging.getLogger("astraflow.runtime")


class RunFailed(RuntimeError):
    """A component reported an error or the run passed its deadline."""


#: errors a pending placement/start/stop future can end with when its worker dies or the
#: actor's constructor fails; anything else is a bug and propagates.
_FUTURE_ERRORS = (OSError, RuntimeError, ValueError, TimeoutError, KeyError, asyncio.CancelledError)

PHASES = ("submitted", "placing", "starting", "serving", "draining", "gone")


@dataclass
class _Worker:
    """One worker job and what the orchestrator has placed on it (see the module docstring)."""

    job: JobRef
    partition: str
    phase: str = "submitted"
    actor: Any = None
    future: Any = None
    """The pending placement, start or stop call of the current phase (None when there is none)."""
    since: float = field(default_factory=time.time)
    """When the current phase began (its deadline counts from here)."""
    joined_at: float | None = None
    note: str | None = None
    """Why the worker is gone (job state, placement failure, removal)."""

    @property
    def gone(self) -> bool:
        return self.phase == "gone"

    @property
    def draining(self) -> bool:
        return self.phase == "draining"

    @property
    def started(self) -> bool:
        return self.phase in ("starting", "serving", "draining") or (self.phase == "gone" and self.actor is not None)

    def enter(self, phase: str, future: Any = None) -> None:
        assert phase in PHASES, phase
        self.phase, self.future, self.since = phase, future, time.time()


@dataclass
class _PartState:
    """What the orchestrator knows about one partition beyond its spec (shown in status.json)."""

    state: str = "active"
    """active | removing (its workers drain) | removed | failed (sbatch refused it, or its
    workers kept dying: not refilled until it is removed and added again)."""
    error: str | None = None
    seen_at: float = field(default_factory=time.time)
    first_trajectory_at: float | None = None
    removal_requested_at: float | None = None
    removed_at: float | None = None
    removal_mode: str | None = None
    failures: int = 0
    """Workers of this partition lost before they served; too many marks it failed."""


@dataclass
class RunResult:
    run_dir: Path
    steps: dict[str, int]
    eval: list[dict[str, Any]]
    ledger: dict[str, Any]
    seconds: float
    interrupted: bool = False
    nodes: dict[str, Any] = field(default_factory=dict)


class Orchestrator:
    def __init__(self, cfg: RunConfig, run_dir: Path, progress: Progress | None = None):
        self.cfg = cfg
        self.paths = RunPaths(run_dir).make()
        self.progress = progress or Progress(enabled=False)
        self.schedulers: dict[str, Any] = {}
        self.workers: dict[str, _Worker] = {}
        self.partitions: dict[str, Partition] = {p.name: p for p in cfg.partitions}
        self.pstate: dict[str, _PartState] = {p.name: _PartState() for p in cfg.partitions}
        self._jobs: dict[str, JobStatus] = {}
        self._rates: deque[tuple[float, dict[str, int]]] = deque()
        self.scheduler_proc: SchedulerProcess | None = None
        self.client: Client | None = None
        self.dl: Any = None
        self.trainers: dict[str, Any] = {}
        self.dashboard: str | None = None
        #: per-iteration phase times of the trainer-centred baseline (``run.mode: sync``)
        self.iterations: list[dict[str, float]] = []

    # ------------------------------------------------------------------ public
    def run(self) -> RunResult:
        t0 = time.time()
        interrupted = False
        if self.paths.summary.exists():  # resuming a finished run: keep its old summary aside
            self.paths.summary.rename(self.paths.summary.with_name(f"summary.{int(time.time())}.json"))
        dump_config(self.cfg, self.paths.config)
        write_desired(self.paths, list(self.partitions.values()))
        try:
            self._start_cluster()
            self._place_core()
            self._loop(t0)
        except KeyboardInterrupt:
            interrupted = True
            self.progress.note("interrupted: stopping cleanly (nodes flush what they wrote)")
        try:
            result = self._shutdown(t0, interrupted)
        finally:
            self._teardown()
        return result

    # ------------------------------------------------------------------ bring-up
    def _start_cluster(self) -> None:
        os.environ["PYTHONPATH"] = str(repo_root()) + (
            os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""
        )
        cc = self.cfg.cluster
        self.scheduler_proc = SchedulerProcess(self.paths, cc.dashboard_host, cc.dashboard_port,
                                               host=cc.scheduler_host, interface=cc.scheduler_interface)
        with self.progress.waiting("starting the Dask scheduler"):
            address = self.scheduler_proc.start()
        self.client = Client(address, timeout=30)
        dash = self.client.scheduler_info().get("services", {}).get("dashboard")
        host = cc.dashboard_host
        self.dashboard = f"http://{host}:{dash}/status" if dash else None
        self.progress.note(f"Dask scheduler {address}; dashboard {self.dashboard}")
        if dash:
            exposed = "" if host in ("127.0.0.1", "localhost", "::1") else f" (bound to {host}: cluster.dashboard_host)"
            self.progress.note(f"AstraFlow page http://{host}:{dash}/astraflow{exposed}")
        write_orchestrator_info(self.paths, self.dashboard, address)
        self._reconcile()
        refused = {n: ps.error for n, ps in self.pstate.items() if ps.state == "failed"}
        if refused:
            raise RunFailed("; ".join(f"partition {n}: {e}" for n, e in refused.items()))
        core = [w for w in self.workers.values() if self.partitions[w.partition].role in ("data", "trainer")]
        rollout = [w for w in self.workers.values() if self.partitions[w.partition].role == "rollout"]
        with self.progress.waiting(f"waiting for {len(self.workers)} workers to join"):
            self._wait_workers([w.job.worker_name for w in core + rollout], self.cfg.cluster.worker_start_timeout_s)

    def run_tag(self) -> str:
        """The ``--comment`` of this run's Slurm jobs: readable and unique per run directory."""
        base = re.sub(r"[^A-Za-z0-9_.-]", "_", self.paths.root.name)[:40] or "run"
        digest = hashlib.sha1(str(self.paths.root.resolve()).encode()).hexdigest()[:8]
        return f"astraflow.{base}.{digest}"

    def _scheduler_for(self, part: Partition):
        if part.scheduler not in self.schedulers:
            cc = self.cfg.cluster
            if part.scheduler == "local":
                kwargs: dict[str, Any] = {"log_dir": self.paths.jobs}
            else:
                iface = cc.worker_interface
                host = None
                if iface is None and cc.scheduler_interface is None and cc.scheduler_host in ("127.0.0.1", "localhost"):
                    host = "127.0.0.1"  # a loopback scheduler: the workers are on this host too
                kwargs = {"job_dir": self.paths.jobs, "tag": self.run_tag(), "setup_lines": tuple(cc.slurm_setup_lines),
                          "interface": iface, "host": host}
                if cc.worker_python:
                    kwargs["python"] = cc.worker_python
            self.schedulers[part.scheduler] = make_scheduler(part.scheduler, **kwargs)
        return self.schedulers[part.scheduler]

    def _scheduler_address(self, part: Partition) -> str:
        """Slurm workers read the scheduler file when they start (a job that waited in the queue
        still finds the scheduler); local ones get the address directly."""
        if part.scheduler == "slurm":
            return str(self.paths.scheduler_file.resolve())
        return self.client.scheduler.address  # type: ignore[union-attr]

    def _reconcile(self) -> None:
        """Submit or remove worker jobs so each desired partition has ``nodes`` live workers.

        Never blocks on a worker: removals only start a drain (finished by `_advance`)."""
        desired, removals = read_desired_file(self.paths)
        for name, part in desired.items():
            if name not in self.pstate or self.pstate[name].state == "removed":
                self.pstate[name] = _PartState()  # new, or added again after its removal
            self.partitions[name] = part
        for name, part in self.partitions.items():
            ps = self.pstate[name]
            mine = [w for w in self.workers.values() if w.partition == name and not w.gone]
            if name not in desired:
                if ps.state in ("active", "failed"):
                    ps.state, ps.removal_requested_at = "removing", time.time()
                    ps.removal_mode = removals.get(name, "drain")
                    self.progress.note(f"removing partition {name} ({ps.removal_mode}): {len(mine)} worker(s)")
                for w in mine:
                    if not w.draining:
                        self._remove_worker(w, drain=ps.removal_mode == "drain")
                if ps.state == "removing" and not mine:
                    ps.state, ps.removed_at = "removed", time.time()
                    self.progress.note(f"partition {name} removed in {ps.removed_at - ps.removal_requested_at:.1f}s")
                continue
            if ps.state == "failed":
                continue
            live = [w for w in mine if not w.draining]
            missing = part.nodes - len(live)
            if missing > 0:
                used = {parse_worker_name(w.job.worker_name)["index"] for w in self.workers.values() if w.partition == name}
                start = max(used) + 1 if used else 0
                try:
                    jobs = self._scheduler_for(part).submit(part, self._scheduler_address(part), missing, start)
                except (SlurmCommandError, ValueError) as err:
                    ps.state, ps.error = "failed", f"submitting workers failed: {err}"
                    self.progress.note(f"partition {name}: {ps.error}")
                    # jobs submitted before the failing one carry our tag: adopt them so they are cancelled
                    jobs = []
                for job in jobs:
                    self.workers[job.worker_name] = _Worker(job=job, partition=name)
                    self.progress.note(f"submitted {job.kind} worker {job.worker_name} ({job.job_id})")

    def _wait_workers(self, names: list[str], timeout: float) -> None:
        deadline = time.time() + timeout
        states: dict[str, str] = {}
        next_poll = 0.0
        while True:
            joined = self._joined()
            missing = [n for n in names if n not in joined]
            if not missing:
                return
            if time.time() >= next_poll:  # job states (PENDING in a Slurm queue, ...) every 5 s
                next_poll = time.time() + 5.0
                states = {j.job_id: str(j.state) for sched in self.schedulers.values() for j in sched.jobs()}
            shown = ", ".join(f"{n} ({states.get(self.workers[n].job.job_id, '?')})" if n in self.workers else n
                              for n in missing[:3])
            self.progress.detail(f"{len(names) - len(missing)}/{len(names)} joined; not yet {shown}"
                                 + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))
            if time.time() > deadline:
                raise RunFailed(f"workers did not join within {timeout:.0f}s: {missing}; see {self.paths.jobs}/*.log")
            time.sleep(0.2)

    def _joined(self) -> dict[str, str]:
        info = connected_workers(self.client)
        return {w["name"]: addr for addr, w in info.items()}

    def _submit_actor(self, cls, worker: str, **kwargs):
        """Construct ``cls`` as an actor pinned to the worker named ``worker``; returns the
        future of the handle (the caller waits with the placement deadline)."""
        return self.client.submit(  # type: ignore[union-attr]
            cls, actor=True, workers=[self._joined()[worker]], allow_other_workers=False, **kwargs
        )

    def _wait_all(self, what: str, futures: dict[str, Any]) -> dict[str, Any]:
        """Wait for every future with the placement deadline, naming what is still missing."""
        deadline = time.time() + self.cfg.cluster.placement_timeout_s
        out = {}
        for key, fut in futures.items():
            self.progress.detail(f"{len(out)}/{len(futures)} ready; waiting for {key}")
            try:
                out[key] = fut.result(timeout=max(deadline - time.time(), 0.1))
            except TimeoutError:
                missing = [k for k in futures if k not in out]
                raise RunFailed(
                    f"{what} did not finish within {self.cfg.cluster.placement_timeout_s:.0f}s "
                    f"(cluster.placement_timeout_s) for {missing}; see the worker logs in {self.paths.jobs}"
                ) from None
        return out

    def _place_core(self) -> None:
        """Data layer first (the others get its handle), then trainers and RaaS nodes, all
        constructed and started concurrently (model loading dominates start-up)."""
        cfg = self.cfg
        data_w = next(w for w in self.workers.values() if self.partitions[w.partition].role == "data")
        trainer_ws = [w for w in self.workers.values() if self.partitions[w.partition].role == "trainer"]
        store_url = cfg.storage.trajectories or str(self.paths.trajectories)
        with self.progress.waiting("placing the data layer"):
            self.dl = self._wait_all("placing the data layer", {"data": self._submit_actor(
                DataLayer, data_w.job.worker_name,
                dataflow=cfg.dataflow, workload=cfg.workload, policies=[p.name for p in cfg.policies],
                store_url=store_url, metrics_path=str(self.paths.metrics), max_steps=cfg.run.max_steps,
                seed=cfg.run.seed, gated=cfg.run.mode == "sync", state_path=str(self.paths.dataflow_state),
            )})["data"]
            data_w.actor = self.dl
        placed = {}
        for i, pol in enumerate(cfg.policies):
            w = trainer_ws[i % len(trainer_ws)]
            placed[pol.name] = self._submit_actor(
                Trainer, w.job.worker_name,
                policy=pol.name, cfg=pol.trainer, model_path=str(pol.model),
                weights_root=str(self.paths.weights), keep_versions=cfg.storage.keep_versions,
                data_layer=self.dl, max_steps=cfg.run.max_steps, seed=cfg.run.seed + i,
                write_deltas=cfg.storage.deltas, optimizer_path=str(self.paths.optimizer_state(pol.name)),
            )
        with self.progress.waiting(f"starting {len(placed)} trainer(s) and the RaaS nodes (model loading)"):
            self.trainers = self._wait_all("placing trainers", placed)
            starts = {p: t.start(run_loop=cfg.run.mode == "async") for p, t in self.trainers.items()}
            for w in trainer_ws + [data_w]:
                w.enter("serving", None)
            self._place_nodes(wait=True)
            self._wait_all("starting trainers (backend build, v0 publish)", starts)

    def _place_nodes(self, wait: bool = False) -> None:
        """Advance every worker one step (place, start, drain, notice losses). With `wait`,
        keep advancing until no rollout worker that already joined is still placing or starting
        (the initial placement; deadline ``cluster.placement_timeout_s`` per phase)."""
        self._advance()
        if not wait:
            return

        def busy() -> bool:
            return any(w.phase in ("placing", "starting") or (w.phase == "submitted" and w.joined_at is not None)
                       for w in self.workers.values() if self.partitions[w.partition].role == "rollout")

        while busy():  # each phase has its own deadline in _advance, so this ends
            time.sleep(0.1)
            self._advance()
        rollout = [w for w in self.workers.values() if self.partitions[w.partition].role == "rollout"]
        if rollout and not any(w.phase == "serving" for w in rollout):
            notes = "; ".join(f"{w.job.worker_name}: {w.note}" for w in rollout if w.note)
            raise RunFailed(f"no RaaS node could start: {notes or 'no rollout worker joined'}")

    def _poll_jobs(self) -> None:
        """One batched job listing per scheduler per tick (`_advance` and the status share it)."""
        jobs: dict[str, JobStatus] = {}
        for sched in self.schedulers.values():
            jobs.update({j.job_id: j for j in sched.jobs()})
        self._jobs = jobs

    def _advance(self) -> None:
        """One step of every worker's state machine; never waits for a worker."""
        self._poll_jobs()
        joined = self._joined()
        now = time.time()
        deadline = self.cfg.cluster.placement_timeout_s
        for name, w in list(self.workers.items()):
            if w.gone:
                continue
            role = self.partitions[w.partition].role
            st = self._jobs.get(w.job.job_id)
            if st is not None and not st.active:
                self._lost(w, f"job {w.job.job_id} {st.state}" + (f" ({st.reason})" if st.reason else ""))
                continue
            if w.joined_at is not None and name not in joined:
                self._lost(w, "worker left the Dask scheduler")
                continue
            if w.joined_at is None and name in joined:
                w.joined_at = now
            if role != "rollout":
                continue  # data and trainer actors are placed by _place_core
            if w.phase == "submitted" and w.joined_at is not None:
                w.enter("placing", self._submit_actor(RaaSNode, name, **self._node_kwargs(name, self.partitions[w.partition])))
            elif w.phase == "placing" and w.future.done():
                try:
                    w.actor = w.future.result(timeout=5)
                except _FUTURE_ERRORS as err:
                    self._fail_placement(w, f"placement failed: {type(err).__name__}: {err}")
                    continue
                w.enter("starting", w.actor.start())
            elif w.phase == "starting" and w.future.done():
                try:
                    versions = w.future.result(timeout=5)
                except _FUTURE_ERRORS as err:
                    self._fail_placement(w, f"placement failed: start: {type(err).__name__}: {err}")
                    continue
                w.enter("serving")
                self.progress.note(f"RaaS node {name} serving {versions}")
            elif w.phase in ("placing", "starting") and now - w.since > deadline:
                self._fail_placement(w, f"placement failed: {w.phase} took more than {deadline:.0f}s "
                                        f"(cluster.placement_timeout_s); see {w.job.log}")
            elif w.phase == "draining":
                timeout = self.cfg.cluster.drain_timeout_s
                if w.future is None or w.future.done() or now - w.since > timeout:
                    if w.future is not None and w.future.done():
                        try:
                            w.future.result(timeout=5)
                        except _FUTURE_ERRORS as err:
                            log.warning("stopping %s during its drain failed: %s", name, err)
                    self._finish_removal(w, "drained" if w.future is not None and w.future.done() else "drain timed out")

    def _lost(self, w: _Worker, why: str) -> None:
        """A worker vanished on its own: requeue its leases now; the partition is refilled by
        `_reconcile` unless it was removed. A lost data or trainer worker ends the run."""
        role = self.partitions[w.partition].role
        name = w.job.worker_name
        was = w.phase
        w.enter("gone")
        w.note = why
        if role != "rollout":
            raise RunFailed(f"{role} worker {name} is gone ({why}); see {w.job.log}")
        n = self.dl.node_gone(name).result(timeout=30) if was in ("starting", "serving", "draining") else 0
        if was != "serving" and was != "draining":
            self.pstate[w.partition].failures += 1
            self._check_failures(w.partition)
        self.progress.note(f"worker {name} is gone ({why}); {n} leases requeued")

    def _replace_failed_nodes(self, state: dict[str, Any]) -> None:
        """A RaaS node that stopped leasing after an error it could not recover from (its
        engine process died more often than ``rollout.engine_restarts``) is replaced like a lost
        worker: its job is cancelled, its leases requeued, its partition refilled. It counts as
        a failure, so a partition whose nodes keep failing stops being refilled."""
        reports = state.get("nodes", {})
        for name, w in list(self.workers.items()):
            if w.phase != "serving" or self.partitions[w.partition].role != "rollout":
                continue
            error = reports.get(name, {}).get("error")
            if error:
                self._scheduler_for(self.partitions[w.partition]).cancel([w.job.job_id])
                self._lost(w, f"RaaS node failed: {error}")
                self.pstate[w.partition].failures += 1
                self._check_failures(w.partition)

    def _fail_placement(self, w: _Worker, why: str) -> None:
        """The actor could not be built or started: cancel the job (its slot is refilled)."""
        self._scheduler_for(self.partitions[w.partition]).cancel([w.job.job_id])
        self._lost(w, why)

    def _check_failures(self, partition: str) -> None:
        part, ps = self.partitions[partition], self.pstate[partition]
        if ps.state == "active" and ps.failures >= 3 * max(part.nodes, 1):
            last = next((w.note for w in reversed(list(self.workers.values()))
                         if w.partition == partition and w.note), "unknown")
            ps.state = "failed"
            ps.error = (f"{ps.failures} workers were lost before serving (last: {last}); not refilling. "
                        f"See the logs in {self.paths.jobs}; remove and add the partition to retry")
            self.progress.note(f"partition {partition}: {ps.error}")

    def _node_kwargs(self, name: str, part: Partition) -> dict[str, Any]:
        cfg = self.cfg
        return dict(
            identity=NodeIdentity(name=name, partition=part.name, region=part.region, hardware=part.hardware),
            rollout=cfg.rollout,
            models={p.name: str(p.model) for p in cfg.policies},
            workload_name=cfg.workload.name,
            workload_params=cfg.workload.params,
            workload_seed=cfg.workload.seed,
            workflow=cfg.workload.workflow,
            sampling=cfg.workload.sampling,
            store_url=cfg.storage.trajectories or str(self.paths.trajectories),
            weights_root=str(self.paths.weights),
            data_layer=self.dl,
            seed=cfg.run.seed,
            use_deltas=cfg.storage.deltas,
        )

    # ------------------------------------------------------------------ the watch loop
    def _loop(self, t0: float) -> None:
        if self.cfg.run.mode == "sync":
            self._sync_loop(t0)
        final = self.cfg.run.max_steps
        eval_on = bool(self.cfg.workload.eval.every)
        eval_waited = False
        while True:
            state = self.dl.state().result(timeout=30)
            trainers = {p: t.state().result(timeout=30) for p, t in self.trainers.items()}
            for p, st in trainers.items():
                if st["error"]:
                    raise RunFailed(f"trainer {p} failed: {st['error']}")
            self._reconcile()
            self._advance()
            self._replace_failed_nodes(state)
            self._track_partitions(state)
            self.progress.update(state, trainers)
            self._write_status(state, trainers)
            done = all(st["done"] for st in trainers.values())
            if done and (not eval_on or self.dl.eval_done(final).result(timeout=30)):
                return
            if done and not eval_waited:
                eval_waited = True
                self.progress.note(f"trainers took {final} steps; waiting for the held-out evaluation of v{final}")
            if time.time() - t0 > self.cfg.run.timeout_s:
                raise RunFailed(f"run deadline of {self.cfg.run.timeout_s:.0f}s passed (run.timeout_s)")
            time.sleep(1.0)

    def _sync_loop(self, t0: float) -> None:
        """The trainer-centred baseline: a driver loop owns the phases (see sync_driver)."""
        from astraflow.runtime.sync_driver import drive_sync

        def tick() -> None:
            if time.time() - self._last_tick > 1.0:
                self._last_tick = time.time()
                state = self.dl.state().result(timeout=30)
                trainers = {p: t.state().result(timeout=30) for p, t in self.trainers.items()}
                self.progress.update(state, trainers)
                self._write_status(state, trainers)

        self._last_tick = 0.0
        cfg = self.cfg
        self.iterations = drive_sync(
            self.dl, self.trainers,
            lambda: [w.actor for w in self.workers.values()
                     if w.actor is not None and w.phase == "serving" and self.partitions[w.partition].role == "rollout"],
            cfg.dataflow.batch_size, cfg.dataflow.batch_size // cfg.workload.group_size,
            cfg.run.max_steps, cfg.run.timeout_s, tick,
        )

    def _track_partitions(self, state: dict[str, Any]) -> None:
        """Per-partition trajectory counts from the data layer's node table, and a rate over
        the last ~10 s (the throughput `astraflow status` and the benchmark report)."""
        done: dict[str, int] = {n: 0 for n in self.partitions}
        for node, info in state.get("nodes", {}).items():
            w = self.workers.get(node)
            if w is not None:
                done[w.partition] = done.get(w.partition, 0) + int(info.get("completed", 0))
        now = time.time()
        for name, n in done.items():
            ps = self.pstate.get(name)
            if ps is not None and n > 0 and ps.first_trajectory_at is None:
                ps.first_trajectory_at = now
        self._rates.append((now, done))
        while len(self._rates) > 2 and now - self._rates[1][0] >= 10.0:
            self._rates.popleft()

    def _partition_status(self) -> dict[str, Any]:
        out = {}
        t1, last = self._rates[-1] if self._rates else (time.time(), {})
        t0, first = self._rates[0] if self._rates else (t1, {})
        for n, p in self.partitions.items():
            ps = self.pstate[n]
            mine = [w for w in self.workers.values() if w.partition == n]
            rate = (last.get(n, 0) - first.get(n, 0)) / (t1 - t0) if t1 > t0 else 0.0
            out[n] = {
                **p.model_dump(mode="json"),
                "state": ps.state,
                "error": ps.error,
                "live": sum(1 for w in mine if not w.gone),
                "serving": sum(1 for w in mine if w.phase == "serving"),
                "draining": sum(1 for w in mine if w.draining),
                "workers": [w.job.worker_name for w in mine if not w.gone],
                "jobs": {w.job.job_id: self._job_state(w) for w in mine if not w.gone},
                "completed": last.get(n, 0),
                "trajectories_per_s": rate,
                "seen_at": ps.seen_at,
                "first_trajectory_at": ps.first_trajectory_at,
                "removal_mode": ps.removal_mode,
                "removal_requested_at": ps.removal_requested_at,
                "removed_at": ps.removed_at,
                "drain_seconds": (ps.removed_at - ps.removal_requested_at) if ps.removed_at and ps.removal_requested_at else None,
            }
        return out

    def _job_state(self, w: _Worker) -> str:
        if w.gone:
            return "GONE"
        st = self._jobs.get(w.job.job_id)
        return st.state if st is not None else "UNKNOWN"

    def _write_status(self, state: dict[str, Any], trainers: dict[str, Any]) -> None:
        write_json_atomic(self.paths.status_file, {
            "written_at": time.time(),
            "run_dir": str(self.paths.root),
            "tag": self.run_tag(),
            "data_layer": state,
            "trainers": trainers,
            "partitions": self._partition_status(),
            "workers": {
                n: {"job_id": w.job.job_id, "partition": w.partition, "kind": w.job.kind,
                    "state": self._job_state(w), "phase": w.phase, "note": w.note,
                    "draining": w.draining, "actor": w.started, "log": str(w.job.log) if w.job.log else None}
                for n, w in self.workers.items()
            },
        })

    def _remove_worker(self, w: _Worker, drain: bool) -> None:
        """Start removing a worker. Drain: the data layer stops leasing to it and the node is
        told to stop (it finishes and writes what it holds); `_advance` cancels the job when
        that returns. Now (or a worker with no node yet): cancel at once, requeue its leases."""
        name = w.job.worker_name
        if drain and w.phase in ("starting", "serving"):
            self.dl.drain(name).result(timeout=30)
            w.enter("draining", w.actor.stop(timeout=self.cfg.cluster.drain_timeout_s))
            self.progress.note(f"draining worker {name}")
            return
        self._finish_removal(w, "removed now" if not drain else "removed before serving")

    def _finish_removal(self, w: _Worker, why: str) -> None:
        name = w.job.worker_name
        had_node = w.phase in ("starting", "serving", "draining")
        self._scheduler_for(self.partitions[w.partition]).cancel([w.job.job_id])
        n = self.dl.node_gone(name).result(timeout=30) if had_node else 0
        w.enter("gone")
        w.note = why
        self.progress.note(f"removed worker {name} ({why}; {n} leases requeued)")

    # ------------------------------------------------------------------ shutdown
    def _shutdown(self, t0: float, interrupted: bool) -> RunResult:
        nodes: dict[str, Any] = {}
        if self.dl is None:
            return RunResult(self.paths.root, {}, [], {}, time.time() - t0, interrupted)
        futures = {n: (w.future if w.draining else w.actor.stop(timeout=60)) for n, w in self.workers.items()
                   if w.phase in ("starting", "serving", "draining") and w.actor is not None
                   and self.partitions[w.partition].role == "rollout"}
        for n, f in futures.items():
            try:
                nodes[n] = f.result(timeout=120)
            except _FUTURE_ERRORS as err:  # the worker died during shutdown: its leases end as run_ended
                nodes[n] = {"node": n, "error": f"{type(err).__name__}: {err}"}
        steps, trainers = {}, {}
        for p, t in self.trainers.items():
            trainers[p] = t.stop(timeout=120).result(timeout=150)
            steps[p] = trainers[p]["version"]
        ledger = self.dl.finish().result(timeout=60)
        state = self.dl.state().result(timeout=30)
        self.dl.close().result(timeout=30)
        result = RunResult(self.paths.root, steps, state["eval"], ledger, time.time() - t0, interrupted, nodes)
        self.paths.summary.write_text(
            json.dumps(
                {"steps": steps, "eval": state["eval"], "ledger": ledger, "seconds": result.seconds,
                 "interrupted": interrupted, "nodes": nodes, "trainers": trainers, "data_layer": state,
                 "iterations": self.iterations,
                 "workers": {n: {"partition": w.partition, "job_id": w.job.job_id, "phase": w.phase, "note": w.note,
                                 "gone": w.gone, "served": w.actor is not None}
                             for n, w in self.workers.items()},
                 "partitions": self._partition_status()},
                indent=2, default=str,
            )
        )
        return result

    def _teardown(self) -> None:
        if self.client is not None:
            self.client.close()
        for sched in self.schedulers.values():
            sched.cancel([w.job.job_id for w in self.workers.values() if w.job.kind == sched.kind and not w.gone])
            if hasattr(sched, "close"):
                sched.close()
        if self.scheduler_proc is not None:
            self.scheduler_proc.stop()
