"""Runtime room: the worker state machine. One `Worker` per worker job, and the `Fleet` that
advances every worker one step per orchestrator tick, so the loop never blocks on a slow
worker (a Slurm job in the queue, a model loading, a drain).

Rollout workers move through these phases::

    submitted --joined--> placing --actor built--> starting --caught up--> serving
        starting/serving --remove (drain)--> draining (node stops leasing, finishes and writes what
                  it holds) --> gone (job cancelled; leases still held are requeued by ``node_gone``)
        any other phase, or removed without a drain --remove--> gone (job cancelled at once)
        any phase --job ended / worker left--> gone (leases requeued, the partition refilled)

Data and trainer workers are placed by the orchestrator and only ever leave the ``serving``
phase by being lost: a lost trainer worker raises `TrainerLost`, a lost data-layer worker
`DataLayerLost`, which the orchestrator answers by placing the component on a new worker
(``cluster.trainer_restarts`` times per policy, ``cluster.data_layer_restarts`` times; see
``restarts``).

Named overlap, *drain vs. lease expiry*: a draining node keeps heartbeating, so its leases stay
valid until it completes them; only after its ``stop`` returns (or ``cluster.drain_timeout_s``
passes) is the job cancelled and whatever it still holds requeued. A task therefore ends once
either way: completed by the draining node, or requeued and completed by another.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from astraflow.runtime.stopping import disk_full, full_disk_of
from schedulers import JobRef, JobStatus, Partition

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig
    from astraflow.runtime.placement import Placement
    from astraflow.runtime.progress import Progress
    from astraflow.runtime.reconcile import PartitionSet

log = logging.getLogger("astraflow.runtime")


class RunFailed(RuntimeError):
    """A component reported an error or the run passed its deadline."""


class WorkerUnusable(RunFailed):
    """A worker nothing can be placed on (``Placement.check_code``: other code): the run fails
    when it was to hold the data layer or a trainer; a RaaS node's placement fails instead (its
    slot is refilled, and a partition whose workers keep failing stops being refilled)."""


class LostBeforeReady(RunFailed):
    """The worker an actor was being placed or started on left the cluster before it was
    ready (``Placement.wait_all``): the trainer restarts look for a lost trainer worker."""


class CoreWorkerLost(RunFailed):
    """A worker holding a trainer or the data layer is gone; left uncaught (at bring-up, or
    its restarts spent) it fails the run."""

    def __init__(self, message: str, worker: Worker, why: str):
        super().__init__(message)
        self.worker, self.why = worker, why


class TrainerLost(CoreWorkerLost):
    """A trainer worker is gone: the orchestrator replaces it (``restarts``) while it may."""


class DataLayerLost(CoreWorkerLost):
    """The data layer's worker is gone: the orchestrator re-places the data layer from its
    durable state (``restarts``) while it may."""


#: errors a pending placement/start/stop future can end with when its worker dies or the
#: actor's constructor fails; anything else is a bug and propagates.
FUTURE_ERRORS = (OSError, RuntimeError, ValueError, TimeoutError, KeyError, asyncio.CancelledError)

#: a worker lost after serving this long (or half a shorter Slurm walltime) is not counted as a
#: failure of its partition (a healthy end: preemption, walltime); one lost sooner is a crash loop
SERVED_LONG_S = 300.0

#: how long the worker jobs may fail to be listed (slurmctld busy, squeue timing out) before the
#: run stops; meanwhile the last listing stands
LISTING_GRACE_S = 300.0

PHASES = ("submitted", "placing", "starting", "serving", "draining", "gone")

#: phases in which a RaaS node exists on the worker (its leases must be requeued when it goes)
NODE_PHASES = ("starting", "serving", "draining")


@dataclass
class Worker:
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
    def name(self) -> str:
        return self.job.worker_name

    @property
    def gone(self) -> bool:
        return self.phase == "gone"

    @property
    def draining(self) -> bool:
        return self.phase == "draining"

    @property
    def has_actor(self) -> bool:
        """It holds an actor now, or held one before it was gone."""
        return self.phase in NODE_PHASES or (self.phase == "gone" and self.actor is not None)

    def enter(self, phase: str, future: Any = None) -> None:
        assert phase in PHASES, phase
        self.phase, self.future, self.since = phase, future, time.time()


class Fleet:
    """Every worker job of the run and the state machine that advances them.

    ``place_node(name, partition)`` submits a RaaS actor to the named worker and returns the
    future of its handle; ``dl`` is the data layer's handle once it is placed (leases of lost
    nodes are requeued through it)."""

    def __init__(self, parts: PartitionSet, placement: Placement, cluster: ClusterConfig, progress: Progress,
                 place_node: Callable[[str, Partition], Any]):
        self.parts = parts
        self.placement = placement
        self.cluster = cluster
        self.progress = progress
        self.place_node = place_node
        self.workers: dict[str, Worker] = {}
        self.jobs: dict[str, JobStatus] = {}
        #: since when listing the jobs fails (None: the last listing worked)
        self._listing_failed_since: float | None = None
        self.dl: Any = None
        #: serving workers whose nodes looked silent past the lease time on the last check
        self._silent: set[str] = set()

    # ------------------------------------------------------------------ queries
    def add(self, job: JobRef, partition: str) -> Worker:
        w = self.workers[job.worker_name] = Worker(job=job, partition=partition)
        return w

    def role(self, w: Worker) -> str:
        return self.parts.partitions[w.partition].role

    def of_role(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if self.role(w) == role]

    def in_partition(self, name: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.partition == name]

    def serving_nodes(self) -> list[Any]:
        """The actors of the RaaS nodes that serve now (the sync driver's nodes)."""
        return [w.actor for w in self.of_role("rollout") if w.actor is not None and w.phase == "serving"]

    def job_state(self, w: Worker) -> str:
        if w.gone:
            return "GONE"
        st = self.jobs.get(w.job.job_id)
        return st.state if st is not None else "UNKNOWN"

    def log_of(self, name: str) -> Path | None:
        """The log file of worker ``name``'s job (None: unknown)."""
        w = self.workers.get(name)
        return Path(w.job.log) if w is not None and w.job.log else None

    def listed_states(self) -> dict[str, str]:
        """``{worker name: job state}`` from a fresh listing (shown while waiting for workers)."""
        by_job = {j.job_id: str(j.state) for sched in self.parts.schedulers.values() for j in sched.jobs()}
        return {n: by_job[w.job.job_id] for n, w in self.workers.items() if w.job.job_id in by_job}

    def poll_jobs(self) -> None:
        """One batched job listing per scheduler per tick (`advance` and the status share it). A
        scheduler that cannot list them this time (a busy slurmctld) leaves its jobs as last
        listed; past `LISTING_GRACE_S` of failures the run stops naming the error."""
        from schedulers.slurm import SlurmCommandError

        jobs: dict[str, JobStatus] = {}
        failed: BaseException | None = None
        for sched in self.parts.schedulers.values():
            try:
                jobs.update({j.job_id: j for j in sched.jobs()})
            except SlurmCommandError as err:
                failed = err
        if failed is None:
            self._listing_failed_since = None
            self.jobs = jobs
            return
        now = time.time()
        if self._listing_failed_since is None:
            self._listing_failed_since = now
            self.progress.note(f"listing the worker jobs failed ({failed}); the last listing stands, asking again")
        if now - self._listing_failed_since > LISTING_GRACE_S:
            raise RunFailed(f"the worker jobs could not be listed for {LISTING_GRACE_S:.0f} s: {failed}; check that "
                            "the Slurm controller answers (squeue), then run again on this run directory")
        self.jobs = {**self.jobs, **jobs}

    # ------------------------------------------------------------------ the state machine
    def advance(self) -> None:
        """One step of every worker's state machine; never waits for a worker. A node that
        cannot be placed or started on a full disk stops the run (its ``OSError`` is raised)."""
        self.poll_jobs()
        joined = self.placement.joined()
        now = time.time()
        for name, w in list(self.workers.items()):
            if w.gone:
                continue
            why = self._why_lost(w, joined)
            if why:
                self.lost(w, why)
                continue
            if w.joined_at is None and name in joined:
                w.joined_at = now
            if self.role(w) == "rollout":  # data and trainer actors are placed by the orchestrator at start
                self._advance_node(w, now)

    def _advance_node(self, w: Worker, now: float) -> None:
        """One step of a rollout worker: its node placed once the worker joined, started once
        placed, serving once started (each within ``cluster.placement_timeout_s``); a drain
        ends when its node stopped or ``cluster.drain_timeout_s`` is up."""
        if w.phase == "submitted" and w.joined_at is not None:
            try:
                placing = self.place_node(w.name, self.parts.partitions[w.partition])
            except WorkerUnusable as err:  # other code there: its slot is refilled, the run goes on
                self.fail_placement(w, f"placement failed: {err}")
                return
            w.enter("placing", placing)
        elif w.phase in ("placing", "starting") and w.future.done():
            self._placed_or_started(w)
        elif w.phase in ("placing", "starting") and now - w.since > self.cluster.placement_timeout_s:
            self.fail_placement(w, f"placement failed: {w.phase} took more than "
                                   f"{self.cluster.placement_timeout_s:.0f}s (cluster.placement_timeout_s); "
                                   f"see {w.job.log}")
        elif w.phase == "draining":
            stopped = w.future is not None and w.future.done()
            if w.future is None or stopped or now - w.since > self.cluster.drain_timeout_s:
                if stopped:
                    try:
                        w.future.result(timeout=5)
                    except FUTURE_ERRORS as err:
                        log.warning("stopping %s during its drain failed: %s", w.name, err)
                self.finish_removal(w, "drained" if stopped else "drain timed out")

    def _placed_or_started(self, w: Worker) -> None:
        """The placing or starting future of ``w`` is done: the next phase, or the placement
        failed (its slot is refilled); an error of a full disk stops the run instead (a new
        node would fail on it too)."""
        step = "" if w.phase == "placing" else "start: "
        try:
            value = w.future.result(timeout=5)
        except FUTURE_ERRORS as err:
            if disk_full(err):
                raise
            self.fail_placement(w, f"placement failed: {step}{type(err).__name__}: {err}")
            return
        if w.phase == "placing":
            w.actor = value
            w.enter("starting", w.actor.start())
        else:
            w.enter("serving")
            self.progress.note(f"RaaS node {w.name} serving {value}")

    def _why_lost(self, w: Worker, joined: dict[str, str]) -> str | None:
        """Why worker ``w`` is lost (its job ended, it left the Dask scheduler), or None."""
        st = self.jobs.get(w.job.job_id)
        if st is not None and not st.active:
            return f"job {w.job.job_id} {st.state}" + (f" ({st.reason})" if st.reason else "")
        if w.joined_at is not None and w.name not in joined:
            return "worker left the Dask scheduler"
        return None

    def check_core(self, wait_s: float = 0.0) -> None:
        """``RunFailed`` (``TrainerLost`` / ``DataLayerLost``) naming a data-layer or trainer worker
        that is lost (called when a component stops answering, so that the run's reason names the
        lost worker, not the failed call, and a lost trainer or data layer is replaced); returns when none is,
        after looking again for up to ``wait_s`` (a call can fail before the job's end or the
        worker's departure is seen)."""
        deadline = time.time() + wait_s
        while True:
            self.poll_jobs()
            joined = self.placement.joined()
            for w in self.workers.values():
                if self.role(w) != "rollout" and not w.gone:
                    why = self._why_lost(w, joined)
                    if why:
                        self.lost(w, why)  # raises RunFailed
            if time.time() >= deadline:
                return
            time.sleep(0.5)

    def place_nodes(self, wait: bool = False) -> None:
        """Advance every worker one step (place, start, drain, notice losses). With `wait`,
        keep advancing until no rollout worker that already joined is still placing or starting
        (the initial placement; deadline ``cluster.placement_timeout_s`` per phase)."""
        self.advance()
        if not wait:
            return

        def busy() -> bool:
            return any(w.phase in ("placing", "starting") or (w.phase == "submitted" and w.joined_at is not None)
                       for w in self.of_role("rollout"))

        while busy():  # each phase has its own deadline in advance(), so this ends
            time.sleep(0.1)
            self.advance()
        rollout = self.of_role("rollout")
        if rollout and not any(w.phase == "serving" for w in rollout):
            notes = "; ".join(f"{w.name}: {w.note}" for w in rollout if w.note)
            raise RunFailed(f"no RaaS node could start: {notes or 'no rollout worker joined'}")

    # ------------------------------------------------------------------ losses and failures
    def lost(self, w: Worker, why: str, failed: bool = False) -> None:
        """A worker vanished on its own (or, ``failed``, is replaced after an error): requeue its
        leases now; the partition is refilled by the reconciler unless it was removed. A worker
        lost before serving or within ``SERVED_LONG_S`` of it (half a shorter walltime) counts as
        a failure of its partition (backoff, then no refill). A lost trainer worker raises ``TrainerLost``, a lost
        data-layer worker ``DataLayerLost``. A job still listed active (requeued by Slurm after a
        node failure, suspended, or only its worker left the scheduler) is cancelled: it would
        hold its node unseen, and its replacement is submitted anyway."""
        role = self.role(w)
        was, served_s = w.phase, time.time() - w.since
        self._silent.discard(w.name)
        w.enter("gone")
        w.note = why
        listed = self.jobs.get(w.job.job_id)
        if role == "rollout" and listed is not None and listed.active:  # core roles: their restarts cancel
            try:
                self.parts.cancel(w)
            except Exception as err:  # gone meanwhile, or the scheduler did not answer: noted, not fatal
                log.warning("cancelling the job %s of lost worker %s failed: %s", w.job.job_id, w.name, err)
        see = f"; see {w.job.log}" if w.job.log and str(w.job.log) not in why else ""  # a job's reason may name it
        if role == "trainer":
            raise TrainerLost(f"trainer worker {w.name} is gone ({why}){see}", w, why)
        if role == "data":
            raise DataLayerLost(f"data-layer worker {w.name} is gone ({why}){see}", w, why)
        if role != "rollout":
            raise RunFailed(f"{role} worker {w.name} is gone ({why}){see}")
        n = self.dl.node_gone(w.name).result(timeout=30) if was in NODE_PHASES else 0
        self.progress.note(f"worker {w.name} is gone ({why}); {n} leases requeued")
        long_s = self.parts.served_long_s(w.partition, SERVED_LONG_S)
        if failed or was not in ("serving", "draining") or (was == "serving" and served_s < long_s):
            self._count_failure(w)

    def forget_silence(self) -> None:
        """Silence seen so far no longer counts (the data layer was lost: nobody could call it)."""
        self._silent.clear()

    def raise_full_disk(self, state: dict[str, Any]) -> None:
        """Raise the ``OSError`` of a serving node that stopped on a full disk (``state``: the
        data layer's), if one did: a new node would fail on it too, so the run stops."""
        reports = state.get("nodes", {})
        for name, w in self.workers.items():
            if w.phase == "serving" and self.role(w) == "rollout":
                if (full := full_disk_of(worker_report(reports, name))) is not None:
                    raise full

    def replace_failed_nodes(self, state: dict[str, Any], silent_after: float) -> None:
        """A RaaS node that stopped leasing after an error it could not recover from (its
        engine process died more often than ``rollout.engine_restarts``, its loop died) or whose
        loop has not called the data layer for ``silent_after`` seconds (its leases are expiring)
        is replaced like a lost worker: its job is cancelled, its leases requeued, its partition
        refilled. It counts as a failure, so a partition whose nodes keep failing stops being
        refilled. A node that stopped on a full disk stops the run instead: its ``OSError`` is
        raised (the run ends the way a full disk ends it, to be resumed). Silence counts when
        seen on two checks in a row."""
        self.raise_full_disk(state)
        reports = state.get("nodes", {})
        now = time.time()
        for name, w in list(self.workers.items()):
            if w.phase != "serving" or self.role(w) != "rollout":
                continue
            report = worker_report(reports, name)
            error = report.get("error")
            silent = report.get("silent_s", now - w.since)  # not heard of yet: since it began serving
            if not error and silent > silent_after and now - w.since > silent_after:
                # on two checks in a row: a data layer that was itself stalled (paused, swapped
                # out) may answer before it has read the heartbeats that queued up meanwhile
                if name in self._silent:
                    error = f"its loop has not called the data layer for {silent:.0f}s (dataflow.lease_seconds)"
                self._silent.add(name)
            else:
                self._silent.discard(name)
            if error:
                self.parts.cancel(w)
                self.lost(w, f"RaaS node failed: {error}", failed=True)

    def fail_placement(self, w: Worker, why: str) -> None:
        """The actor could not be built or started: cancel the job (its slot is refilled)."""
        self.parts.cancel(w)
        self.lost(w, why)

    def _count_failure(self, w: Worker) -> None:
        last = next((x.note for x in reversed(list(self.workers.values()))
                     if x.partition == w.partition and x.note), "unknown")
        serving = sum(1 for x in self.in_partition(w.partition) if not x.gone and x.phase == "serving")
        self.parts.record_failure(w.partition, last, serving)

    # ------------------------------------------------------------------ removal
    def remove(self, w: Worker, drain: bool) -> None:
        """Start removing a worker. Drain: the data layer stops leasing to it and the node is
        told to stop (it finishes and writes what it holds); `advance` cancels the job when
        that returns. Now (or a worker with no node yet): cancel at once, requeue its leases."""
        if drain and w.phase in ("starting", "serving"):
            self.dl.drain(w.name).result(timeout=30)
            w.enter("draining", w.actor.stop(timeout=self.cluster.drain_timeout_s))
            self.progress.note(f"draining worker {w.name}")
            return
        self.finish_removal(w, "removed now" if not drain else "removed before serving")

    def finish_removal(self, w: Worker, why: str) -> None:
        had_node = w.phase in NODE_PHASES
        self.parts.cancel(w)
        n = self.dl.node_gone(w.name).result(timeout=30) if had_node else 0
        w.enter("gone")
        w.note = why
        self.progress.note(f"removed worker {w.name} ({why}; {n} leases requeued)")


def worker_report(reports: dict[str, Any], worker: str) -> dict[str, Any]:
    """The data layer's report of the node on ``worker``; with several nodes per worker
    (``rollout.nodes_per_worker``), the worst of them: the first error (a full disk first),
    the longest silence."""
    members = [r for r in reports.values() if r.get("worker") == worker]
    if not members:
        return reports.get(worker, {})
    failed = [r for r in members if r.get("error")]
    first = next((r for r in failed if full_disk_of(r)), failed[0] if failed else {})  # a full disk stops the run
    return {"error": first.get("error"), "error_os": first.get("error_os"),
            "silent_s": max(r.get("silent_s", 0.0) for r in members)}
