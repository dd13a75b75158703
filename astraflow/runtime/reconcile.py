"""Runtime room: partition reconciliation. The *desired* partitions (the config, plus
``astraflow partitions add/remove`` written to ``control/partitions.json``) against the worker
jobs that exist: submit the missing workers, start removing the workers of a partition that
left the set (drain or now) or the workers beyond a partition's lowered ``nodes`` (drained),
back off refilling a partition whose workers fail, and stop
refilling it when they keep failing. A partition of the file whose ``env`` or
``sbatch_options`` the run's allowlists refuse (`schedulers.policy`), or whose ``rollout:``
settings do not fit the run's config (`astraflow.partition_settings`), is never started.

`PartitionSet` owns the partitions, what the orchestrator knows about each (`PartitionState`,
shown in ``status.json``) and the scheduler backends that start their workers. It never blocks
on a worker: a removal only starts a drain, which the worker state machine finishes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from astraflow.runtime.cluster import export_repo_path
from astraflow.runtime.control import DEFAULT_REMOVAL, PartitionError, read_desired_file, set_partition_nodes
from astraflow.runtime.jobrecords import JobRecords
from schedulers import Partition, TLSFiles, UnknownJobError, make_scheduler, parse_worker_name, walltime_seconds
from schedulers.forkserver import ForkServer
from schedulers.local import start_fork_server
from schedulers.policy import WorkerPolicy
from schedulers.slurm import SlurmCommandError
from schedulers.slurm import run_tag as slurm_run_tag
from storage.paths import RunPaths

log = logging.getLogger("astraflow.runtime")

if TYPE_CHECKING:
    from astraflow.config import ClusterConfig
    from astraflow.runtime.progress import Progress
    from astraflow.runtime.workers import Fleet, Worker

#: a partition whose workers failed this many times per desired node is marked failed and no
#: longer refilled
FAILURES_PER_NODE = 3

#: after its n-th failure a partition is refilled only after REFILL_BACKOFF_S * 2**(n-1)
#: seconds (at most REFILL_BACKOFF_MAX_S): a crash loop does not resubmit at the tick rate
REFILL_BACKOFF_S = 2.0
REFILL_BACKOFF_MAX_S = 60.0


@dataclass
class PartitionState:
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
    """Workers of this partition that failed (lost before serving or soon after, replaced after
    an error); too many mark it failed."""
    refill_at: float | None = None
    """No worker is submitted for it before this time (the backoff after its last failure)."""
    shrunk_at: float | None = None
    """When its workers that kept failing were given up (``record_failure``): the autoscaler
    does not grow it again for its memory (``autoscale.memory_s``)."""


def run_tag(paths: RunPaths) -> str:
    """The ``--comment`` of a run's Slurm jobs (``schedulers.slurm.run_tag``)."""
    return slurm_run_tag(paths.root)


#: what the fork server of local workers imports once for all of them (``schedulers.forkserver``):
#: the Dask worker, the modules of the actors placed on workers and what building a model imports
LOCAL_PRELOAD = (
    "distributed.cli.dask_worker", "tornado.platform.asyncio", "storage.ownership", "astraflow.workloads.datafiles",
    "astraflow.codeversion", "astraflow.runtime.construct", "astraflow.dataflow.layer", "astraflow.rollout.node",
    "astraflow.rollout.node_group", "astraflow.training.trainer", "astraflow.workloads", "astraflow.models",
    "astraflow.model_loading", "astraflow.rollout.hf_engine", "astraflow.training.torch_backend",
    "torch.distributed.checkpoint", "transformers", "transformers.activations", "transformers.masking_utils",
    "transformers.modeling_layers", "transformers.models.auto.auto_factory",
    "transformers.tokenization_utils_tokenizers",
)


def local_fork_server(paths: RunPaths, cluster: ClusterConfig, partitions: list[Partition]) -> ForkServer | None:
    """The fork server the run's local workers are forked from (``cluster.local_fork``), started
    now so that its imports overlap the run's own start; None without local partitions."""
    if not cluster.local_fork or not any(p.scheduler == "local" for p in partitions):
        return None
    export_repo_path()  # what the workers' environment will have (`Placement.start`)
    return start_fork_server(paths.make().jobs, LOCAL_PRELOAD)


def run_scheduler(kind: str, paths: RunPaths, cluster: ClusterConfig, tls: TLSFiles | None,
                  fork_server: ForkServer | None = None):
    """The scheduler backend of `kind` for the run in `paths`, set up from the run's cluster
    settings (its jobs tagged with `run_tag`, so every incarnation of the run finds them);
    local workers are forked from `fork_server` where given (`local_fork_server`)."""
    cc = cluster
    loopback = cc.scheduler_host in ("127.0.0.1", "localhost")
    if kind == "local":
        # on this host; reachable from the others where the scheduler is (workers on other hosts
        # call the data layer and the trainers directly at their workers' addresses)
        kwargs: dict[str, Any] = {"log_dir": paths.jobs, "interface": cc.worker_interface or cc.scheduler_interface,
                                  "host": "127.0.0.1" if loopback else cc.scheduler_host,
                                  "fork_server": fork_server}
    else:
        iface = cc.worker_interface
        host = None
        if iface is None and cc.scheduler_interface is None and loopback:
            host = "127.0.0.1"  # a loopback scheduler: the workers are on this host too
        kwargs = {"job_dir": paths.jobs, "tag": run_tag(paths),
                  "setup_lines": tuple(cc.slurm_setup_lines), "interface": iface, "host": host}
        if cc.worker_python:
            kwargs["python"] = cc.worker_python
    return make_scheduler(kind, tls=tls, **kwargs)


class PartitionSet:
    """The run's partitions, their states and the scheduler backends of their workers."""

    def __init__(self, partitions: list[Partition], paths: RunPaths, cluster: ClusterConfig, progress: Progress,
                 check_settings: Callable[[Partition], None] | None = None, fork_server: ForkServer | None = None):
        self.paths = paths
        #: where the local scheduler forks its workers from (it closes the server)
        self.fork_server = fork_server
        self.cluster = cluster
        self.progress = progress
        self.partitions: dict[str, Partition] = {p.name: p for p in partitions}
        self.state: dict[str, PartitionState] = {p.name: PartitionState() for p in partitions}
        self.schedulers: dict[str, Any] = {}
        #: the run's TLS certificates, given to every worker (set once the scheduler started)
        self.tls: TLSFiles | None = None
        #: why the desired-partitions file was last unreadable (noted once per new error)
        self._desired_error: str | None = None
        self.policy = WorkerPolicy.of(cluster.worker_env_allowlist, cluster.sbatch_options_allowlist)
        #: raises ValueError for a partition whose settings do not fit the run's config
        self.check_settings = check_settings
        #: the refusals by the allowlists already noted
        self._refusals_noted: set[str] = set()
        #: every job this incarnation submits, recorded for the next one (`jobrecords`)
        self.records = JobRecords(paths)
        #: per scheduler kind: jobs whose cancel failed, tried again each tick
        self._cancel_later: dict[str, set[str]] = {}

    def scheduler_for(self, part: Partition):
        if part.scheduler not in self.schedulers:
            self.schedulers[part.scheduler] = run_scheduler(part.scheduler, self.paths, self.cluster, self.tls,
                                                            self.fork_server if part.scheduler == "local" else None)
        return self.schedulers[part.scheduler]

    def cancel(self, w: Worker, wait: bool = False) -> None:
        """Cancel the job of worker `w` (its actor dies with it); ``wait``: until its processes are
        gone. A cancel that fails (a Slurm controller that did not answer in time) does not stop
        the run: it is tried again each tick (`retry_cancels`), and at the end."""
        sched = self.scheduler_for(self.partitions[w.partition])
        try:
            sched.cancel([w.job.job_id], wait=wait)
        except UnknownJobError:  # ended meanwhile: nothing to cancel
            pass
        except (SlurmCommandError, OSError) as err:
            self._cancel_later.setdefault(sched.kind, set()).add(w.job.job_id)
            self.progress.note(f"cancelling job {w.job.job_id} of worker {w.name} failed ({err}); trying again")

    def retry_cancels(self) -> None:
        """Cancel again the jobs whose cancel failed; those that fail again stay for the next tick."""
        for kind, ids in list(self._cancel_later.items()):
            sched = self.schedulers.get(kind)
            if sched is None or not ids:
                continue
            for job_id in sorted(ids):
                try:
                    sched.cancel([job_id])
                except UnknownJobError:
                    pass
                except (SlurmCommandError, OSError) as err:
                    log.info("cancelling job %s failed again (%s)", job_id, err)
                    continue
                ids.discard(job_id)

    def uncancelled(self, kind: str) -> list[str]:
        """Jobs of ``kind`` whose cancel has not got through yet (teardown cancels them too)."""
        return sorted(self._cancel_later.get(kind, ()))

    def refused(self) -> dict[str, str | None]:
        """Partitions marked failed, with why (at start, a refused partition ends the run)."""
        return {n: ps.error for n, ps in self.state.items() if ps.state == "failed"}

    def rollout_exhausted(self, fleet: Fleet) -> str | None:
        """Why no episode can be rolled out again (None: one can): every rollout partition stopped
        being refilled (failed; removed ones aside) and no rollout worker is left. The run ends
        with this instead of idling until the trainers' batch timeout blames them."""
        rollout = {n: ps for n, ps in self.state.items()
                   if n in self.partitions and self.partitions[n].role == "rollout"}
        failed = {n: ps.error for n, ps in rollout.items() if ps.state == "failed"}
        if not failed or any(ps.state not in ("failed", "removed") for ps in rollout.values()):
            return None
        if any(not w.gone for w in fleet.of_role("rollout")):
            return None
        said = "; ".join(f"partition {n}: {why}" for n, why in failed.items())
        return f"no rollout node is left and no rollout partition is refilled any more ({said})"

    def served_long_s(self, name: str, served_long_s: float) -> float:
        """How long a worker of partition ``name`` must have served for its loss not to count as a
        failure: ``served_long_s``, or half the walltime of a Slurm partition whose walltime is
        shorter than twice that (its healthy workers reach the walltime sooner)."""
        part = self.partitions.get(name)
        wall = walltime_seconds(part.walltime) if part is not None and part.scheduler == "slurm" else None
        return served_long_s if wall is None else min(served_long_s, wall / 2)

    def record_failure(self, name: str, last_note: str, serving: int = 0) -> None:
        """A worker of partition `name` failed (lost before it served or soon after, or its node
        failed): the partition is refilled only after a growing backoff, and too many failures
        mark it failed so it is not refilled again and again. An autoscaled partition whose
        ``serving`` workers still serve is not failed for the workers it could not add: it goes
        back to the size that serves (the autoscaler does not grow it for its memory). All of it is noted in
        the progress and shown by ``astraflow status``."""
        part, ps = self.partitions[name], self.state[name]
        ps.failures += 1
        limit = FAILURES_PER_NODE * max(part.nodes, 1)
        if ps.state == "active" and ps.failures >= limit and self._shrink_to_serving(name, serving, last_note):
            return
        if ps.state == "active" and ps.failures >= limit:
            ps.state, ps.refill_at = "failed", None
            ps.error = (f"{ps.failures} workers failed (last: {last_note}); not refilling. "
                        f"See the logs in {self.paths.jobs}; remove and add the partition to retry")
            self.progress.note(f"partition {name}: {ps.error}")
        elif ps.state == "active":
            delay = min(REFILL_BACKOFF_S * 2 ** (ps.failures - 1), REFILL_BACKOFF_MAX_S)
            ps.refill_at = time.time() + delay
            self.progress.note(f"partition {name}: worker failure {ps.failures} of {limit} before it stops being "
                               f"refilled (last: {last_note}); refilling in {delay:.0f}s")

    def _shrink_to_serving(self, name: str, serving: int, last_note: str) -> bool:
        """Put an autoscaled partition back to its ``serving`` workers (at least its
        ``min_nodes``) after its added workers kept failing; False where that does not apply."""
        part, ps = self.partitions[name], self.state[name]
        keep = max(serving, part.autoscale.min_nodes) if part.autoscale is not None else part.nodes
        if not serving or keep >= part.nodes:
            return False
        try:
            set_partition_nodes(self.paths, name, keep)
        except (PartitionError, ValueError) as err:  # its file locked or damaged: fail it as any other
            log.warning("partition %s: going back to %d worker(s) failed: %s", name, keep, err)
            return False
        self.partitions[name] = part.model_copy(update={"nodes": keep})
        self.progress.note(f"partition {name}: {ps.failures} workers failed (last: {last_note}); back to the "
                           f"{keep} worker(s) that serve, from {part.nodes} (not grown again for autoscale.memory_s)")
        ps.failures, ps.refill_at, ps.shrunk_at = 0, None, time.time()
        return True

    def _refusal(self, part: Partition) -> str | None:
        """Why the run does not start ``part`` (None: it may): the allowlists, or settings
        (``rollout:``, ``trainer:``) that do not fit the run's config."""
        problems = self.policy.problems(part)
        if problems:
            return f"refused by the run's allowlists: {'; '.join(problems)}"
        if self.check_settings is not None:
            try:
                self.check_settings(part)
            except ValueError as err:
                return f"refused: {err}"
        return None

    def _refuse_disallowed(self, desired: dict[str, Partition]) -> None:
        """Keep partitions the run refuses (``_refusal``) from starting: a new one is marked
        failed with why (``astraflow partitions add --wait`` reports it), one the run has keeps
        the spec it runs with. Each refusal is noted once."""
        for name, part in list(desired.items()):
            why = self._refusal(part)
            if why is None:
                continue
            ps, old = self.state.get(name), self.partitions.get(name)
            if ps is not None and ps.state != "removed" and old is not None and self._refusal(old) is None:
                desired[name] = old
                why = f"{why} (the run keeps the partition as it was)"
            elif ps is None or ps.state != "failed":
                self.state[name] = PartitionState(state="failed", error=why)
            note = f"partition {name} in {self.paths.desired_partitions}: {why}"
            if note not in self._refusals_noted:
                self._refusals_noted.add(note)
                self.progress.note(note)

    def reconcile(self, fleet: Fleet, address_for: Callable[[Partition], str]) -> None:
        """Submit or remove worker jobs so each desired partition has ``nodes`` live workers.

        Never blocks on a worker: removals only start a drain (finished by `Fleet.advance`)."""
        self.retry_cancels()
        desired, removals = self._read_desired()
        self._refuse_disallowed(desired)
        for name, part in desired.items():
            if name not in self.state or self.state[name].state == "removed":
                self.state[name] = PartitionState()  # new, or added again after its removal
            self.partitions[name] = part
        for name, part in self.partitions.items():
            ps = self.state[name]
            mine = [w for w in fleet.in_partition(name) if not w.gone]
            if name not in desired:
                self._remove(fleet, name, mine, removals.get(name, DEFAULT_REMOVAL))
                continue
            if ps.state == "failed":
                continue
            live = [w for w in mine if not w.draining]
            if len(live) > part.nodes:
                self._shrink(fleet, name, live, len(live) - part.nodes)
            elif len(live) < part.nodes and (ps.refill_at is None or time.time() >= ps.refill_at):
                self._grow(fleet, name, live, part.nodes - len(live), address_for)

    def _read_desired(self) -> tuple[dict[str, Partition], dict[str, str]]:
        """The desired partitions and the removal modes asked for; a damaged file (said once) keeps
        the partitions the run has, none of them removed."""
        try:
            desired, removals = read_desired_file(self.paths)
        except PartitionError as err:
            if str(err) != self._desired_error:
                self.progress.note(str(err))
            self._desired_error = str(err)
            return {n: p for n, p in self.partitions.items()
                    if self.state[n].state not in ("removing", "removed")}, {}
        self._desired_error = None
        return desired, removals

    def _remove(self, fleet: Fleet, name: str, mine: list[Worker], mode: str) -> None:
        """Partition ``name`` is no longer desired: its workers drained (or cancelled, by
        ``mode``), and it is removed once none is left."""
        ps = self.state[name]
        if ps.state in ("active", "failed"):
            ps.state, ps.removal_requested_at, ps.removal_mode = "removing", time.time(), mode
            self.progress.note(f"removing partition {name} ({ps.removal_mode}): {len(mine)} worker(s)")
        for w in mine:
            if not w.draining:
                fleet.remove(w, drain=ps.removal_mode == "drain")
        if ps.state == "removing" and not mine:
            ps.state, ps.removed_at = "removed", time.time()
            self.progress.note(f"partition {name} removed in {ps.removed_at - ps.removal_requested_at:.1f}s")

    def _grow(self, fleet: Fleet, name: str, live: list[Worker], missing: int,
              address_for: Callable[[Partition], str]) -> None:
        """Submit ``missing`` workers of partition ``name``, numbered after its others. A refused
        submission fails a partition with no live worker; one that serves backs off and retries
        (a queue limit, a slow controller)."""
        part, ps = self.partitions[name], self.state[name]
        used = {parse_worker_name(w.name)["index"] for w in fleet.in_partition(name)}
        start = max(used) + 1 if used else 0
        try:
            jobs = self.scheduler_for(part).submit(part, address_for(part), missing, start)
        except (SlurmCommandError, ValueError, OSError) as err:  # OSError: a local worker that cannot start
            jobs = []
            if live:
                self.progress.note(f"partition {name}: submitting {missing} more worker(s) failed: {err}")
                self.record_failure(name, f"submitting workers failed: {err}",
                                    sum(1 for w in live if w.phase == "serving"))
            else:
                ps.state, ps.error = "failed", f"submitting workers failed: {err}"
                self.progress.note(f"partition {name}: {ps.error}")
        for job in jobs:
            fleet.add(job, name)
            self.progress.note(f"submitted {job.kind} worker {job.worker_name} ({job.job_id})")
        # after the fleet has them: a failed write still leaves them cancelled at the end
        self.records.add(jobs)

    def _shrink(self, fleet: Fleet, name: str, live: list[Worker], excess: int) -> None:
        """Partition ``name`` wants fewer workers than it has (its ``nodes`` went down: the
        autoscaler, or an edited desired file): remove ``excess`` of them, those not serving
        yet first (nothing to drain), then the newest; each is drained like a removed partition's."""
        order = sorted(live, key=lambda w: (w.phase == "serving", -parse_worker_name(w.name)["index"]))
        for w in order[:excess]:
            fleet.remove(w, drain=True)
        self.progress.note(f"partition {name}: {self.partitions[name].nodes} worker(s) wanted, "
                           f"removing {', '.join(w.name for w in order[:excess])}")
