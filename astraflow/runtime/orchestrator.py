"""Runtime room: the orchestrator, the thin owner of a run's loop. It owns no training logic
and delegates each concern to its own module:

* bring-up and placement (`placement`): the Dask scheduler, actors on named workers, deadlines;
* the worker state machine (`workers`): phases, losses, failed nodes, removals and drains;
* partition reconciliation (`reconcile`): desired partitions against the worker jobs;
* the autoscaler (`autoscaling`): the partitions' desired sizes from the trainers' wait;
* restarts (`restarts`): a lost trainer worker (or backend rank) replaced, its trainer resumed; a lost
  data-layer worker replaced, the data layer restored from its durable state;
* status and summary (`monitoring.writer`): ``control/status.json`` each tick, ``summary.json``.
* the way out (`shutdown`): components stopped in order, the summary, jobs cancelled. Each tick of its loop it:

1. reads the *desired* partitions and submits or cancels worker jobs to match;
2. advances every worker one step: places a RaaS actor on every rollout worker that joined and
   has none (it catches up to the latest weights before leasing), and tells the data layer
   about workers that vanished (their leases are requeued at once, not at expiry);
3. shows progress and writes the status, and ends the run when every trainer took its steps
   and the last evaluation finished (or on Ctrl-C / SIGTERM, a lost data-layer or trainer
   worker past ``cluster.data_layer_restarts`` / ``cluster.trainer_restarts``, a component
   error, an actor call that raised, the run deadline). A lost trainer or data-layer worker
   within its restarts is replaced (`restarts`) and the loop goes on.

Every ending takes one path out (`stopping`): RaaS nodes drain and flush (nothing written is
lost), trainers stop, the data layer ends every open task in the ledger and closes
``metrics.jsonl``, ``summary.json`` records the ending (``status``, ``reason``), worker jobs are
cancelled by id, the scheduler process is stopped by pid. After a failure or a signal every
wait on a component is bounded by ``cluster.stop_grace_s`` in all, and a component that is gone
is skipped (noted in the summary); then a failed run raises ``RunFailed`` with its reason.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from pathlib import Path
from typing import Any

from astraflow.config import RunConfig, dump_config
from astraflow.context_fit import check_engine_positions, engine_limit, model_limits
from astraflow.dataflow.layer import DataLayer
from astraflow.partition_settings import effective_rollout, partition_capacity
from astraflow.rollout.node import RaaSNode
from astraflow.rollout.node_group import RaaSNodeGroup
from astraflow.runtime.autoscaling import autoscale_driver
from astraflow.runtime.control import PartitionError, desired_lock, read_desired_file, write_desired
from astraflow.runtime.jobrecords import PreviousJobs
from astraflow.runtime.monitoring import StatusWriter, Tick, archive_summary
from astraflow.runtime.monitoring.disk import DiskWatch, run_places
from astraflow.runtime.monitoring.writer import STATUS_EVALS
from astraflow.runtime.placement import (Placement, SchedulerLost, data_layer_kwargs, loopback_hint, node_kwargs,
                                        store_url, trainer_kwargs)
from astraflow.runtime.progress import Progress
from astraflow.runtime.reconcile import PartitionSet, local_fork_server, run_tag
from astraflow.runtime.restarts import DataLayerRestarts, TrainerRestarts, hung, note
from astraflow.runtime.shutdown import RunResult, Shutdown
from astraflow.runtime.stopping import (STOPPING, Ending, NothingCompletes, deadline_reason, disk_full,
                                        disk_full_reason, full_disk_of, interrupted, is_disk_full_reason, rule_failed)
from astraflow.runtime.workers import FUTURE_ERRORS, PHASES, DataLayerLost, Fleet, RunFailed, TrainerLost, Worker
from astraflow.training.numerics import NonFiniteError
from astraflow.training.trainer import Trainer
from schedulers import Partition
from schedulers.forkserver import ForkServer
from storage.paths import RunPaths
from storage.weights import WeightStore

__all__ = ["PHASES", "Orchestrator", "RunFailed", "RunResult", "Worker"]

log = logging.getLogger("astraflow.runtime")

#: rollout tasks that may fail, none completing, before the run stops (at least 4 batches' worth)
FAILED_WITHOUT_COMPLETION = 256
#: evaluation records a tick reads (the status file keeps ``STATUS_EVALS`` of them)
TICK_EVALS = 4 * STATUS_EVALS


class Orchestrator(Shutdown):
    def __init__(self, cfg: RunConfig, run_dir: Path, progress: Progress | None = None,
                 previous_jobs: PreviousJobs | None = None, fork_server: ForkServer | None = None,
                 data_read_s: float = 0.0):
        """`previous_jobs`: what `launch` cancelled of the previous incarnation's worker jobs (recorded in
        the status and the summary); `fork_server`: what local workers are forked from (`reconcile.local_fork_server`;
        started here when not given); `data_read_s`: how long `launch` took to read the data (`Placement`)."""
        self.cfg = cfg
        self.paths = RunPaths(run_dir).make()
        self.progress = progress or Progress(enabled=False)
        self.placement = Placement(self.paths, cfg.cluster, self.progress, data_read_s)
        #: what judging a partition needs of the workload and the models, read once
        self._episode_tokens, self._limits = cfg.episode_tokens(), model_limits(cfg)
        self.parts = PartitionSet(list(cfg.partitions), self.paths, cfg.cluster, self.progress,
                                  check_settings=self._check_partition,
                                  fork_server=fork_server or local_fork_server(self.paths, cfg.cluster,
                                                                               list(cfg.partitions)))
        self.fleet = Fleet(self.parts, self.placement, cfg.cluster, self.progress, self._place_node)
        self.status = StatusWriter(self.paths, self.run_tag(), self.parts, self.fleet)
        self.status.previous_jobs = (previous_jobs or PreviousJobs()).as_dict()
        self.nothing_completes = NothingCompletes.of_run(cfg, FAILED_WITHOUT_COMPLETION)
        self.status.capacity = lambda name: partition_capacity(cfg.rollout, self.parts.partitions[name])
        #: the trainers' handles by policy; replaced in place when a trainer is restarted
        self.trainers: dict[str, Any] = {}
        self.restarts = TrainerRestarts(cfg, self.paths, self.fleet, self.placement, self.progress,
                                        self.trainers, self._reconcile)
        self.status.trainer_restarts = self.restarts.record
        self.dl_restarts = DataLayerRestarts(cfg, self.paths, self.fleet, self.placement, self.progress,
                                             self.trainers, self._reconcile)
        self.status.data_layer_restarts = self.dl_restarts.record
        #: grows and drains the partitions with autoscale bounds (None: no autoscaling)
        self.autoscaler = autoscale_driver(cfg, self.paths, self.parts, self.fleet, self.progress)
        if self.autoscaler is not None:
            self.status.autoscale = self.autoscaler.status
        #: free space on the run directory's filesystem and the trajectory store's
        self.disk = DiskWatch(run_places(self.paths.root, store_url(cfg, self.paths)), _disk_advice(cfg))
        self.status.disk = self.disk.view
        #: the last state read from the components (the summary's fallback when they are gone)
        self.last_tick: Tick | None = None
        #: per-iteration phase times of the trainer-centred baseline (``run.mode: sync``)
        self.iterations: list[dict[str, float]] = []

    # ------------------------------------------------------------------ public
    @property
    def dl(self) -> Any:
        """The data layer's actor handle (None before it is placed)."""
        return self.fleet.dl

    @property
    def workers(self) -> dict[str, Worker]:
        return self.fleet.workers

    @property
    def partitions(self) -> dict[str, Partition]:
        return self.parts.partitions

    @property
    def dashboard(self) -> str | None:
        return self.placement.dashboard

    def run_tag(self) -> str:
        """The ``--comment`` of this run's Slurm jobs: readable and unique per run directory."""
        return run_tag(self.paths)

    def run(self) -> RunResult:
        """Run until the run ends, however it ends, then stop it on the one way out (module
        docstring). Returns the result of a completed or interrupted run; raises ``RunFailed``
        with the reason of a failed one, after its summary is written and its jobs cancelled."""
        t0 = time.time()
        archive_summary(self.paths)  # resuming a finished run: keep its old summary aside
        dump_config(self.cfg, self.paths.config)
        self._publish_desired()
        ending = Ending("completed")
        try:
            self._bring_up()
            self._place_core()
            self._loop(t0)
        except KeyboardInterrupt as sig:  # Ctrl-C, SIGTERM or the requeue signal (launch turns them into this)
            ending = interrupted(sig)
            self.progress.note(f"{ending.reason}: stopping (nodes flush what they wrote)")
        except RunFailed as err:
            ending = Ending("failed", str(err), requeue=isinstance(err, SchedulerLost))
        except NonFiniteError as err:  # the sync driver's trainer step stopped on its numerics guard
            ending = Ending("failed", f"NonFiniteError: {err}")
        except Exception as err:  # an actor call that raised, a bug: the same way out, traceback in the log
            if disk_full(err):
                ending = Ending("failed", disk_full_reason(err, self.paths.root))
            elif (gone := self.placement.scheduler_gone()) is not None:
                ending = Ending("failed", gone, requeue=True)
            else:
                where = self.paths.log("orchestrator")
                ending = Ending("failed", f"{type(err).__name__}: {err} (traceback in {where})")
                with contextlib.suppress(OSError), open(where, "a") as f:
                    traceback.print_exc(file=f)
        except BaseException:  # SystemExit and the like: no summary, but no orphaned jobs either
            self._teardown()
            raise
        STOPPING.set()  # on the way out, however the run ended: a stop signal now only says so
        try:
            result = self._shutdown(t0, ending)
        except OSError as err:  # the summary could not be written: the run still leaves in one line
            if not disk_full(err):
                raise
            full = disk_full_reason(err, self.paths.root)
            before = f"{ending.reason}; then " if ending.reason and not is_disk_full_reason(ending.reason) else ""
            raise RunFailed(f"{before}{full}; summary.json could not be written") from None
        finally:
            self._teardown()
        if ending.status == "failed":
            raise (SchedulerLost if ending.requeue else RunFailed)(f"{ending.reason} (summary in {self.paths.summary})")
        return result

    def _publish_desired(self) -> None:
        """The desired partitions: the config's, and on a resume also those the previous run
        had added mid-run (``partitions add``), which the reconcile loop then adds again. A
        partition the config names takes the config's settings; one removed (``partitions
        remove``, also one the config names) is not brought back, and stays recorded as removed."""
        extra: list[Partition] = []
        with desired_lock(self.paths):
            try:
                before, removals = read_desired_file(self.paths)
            except PartitionError as err:
                before, removals = {}, {}
                self.progress.note(f"the previous run's desired partitions are unreadable ({err}): "
                                   "only the config's are brought up")
            extra = [p for n, p in before.items() if n not in self.partitions and n not in removals]
            kept_out = [n for n in self.partitions if n in removals]
            if not any(p.role == "rollout" for n, p in [*self.partitions.items(), *((p.name, p) for p in extra)]
                       if n not in kept_out):
                kept_out = []  # no rollout partition would be left: the config's come back after all
            mine = [p for n, p in self.partitions.items() if n not in kept_out]
            write_desired(self.paths, [*mine, *extra], {n: m for n, m in removals.items()
                                                         if n not in self.partitions or n in kept_out})
        for p in extra:
            self.progress.note(f"partition {p.name}: added to the previous run (partitions add), added again")
        for n in kept_out:
            self.progress.note(f"partition {n}: removed from the previous run (partitions remove), not brought up "
                               "again; `astraflow partitions add` brings it back")

    # ------------------------------------------------------------------ bring-up
    def _reconcile(self) -> None:
        self.parts.reconcile(self.fleet, self.placement.scheduler_contact)

    def _bring_up(self) -> None:
        """Start the scheduler, submit every configured worker job, wait until all joined."""
        self.placement.start()
        self.parts.tls = self.placement.tls
        self._reconcile()
        refused = self.parts.refused()
        if refused:
            raise RunFailed("; ".join(f"partition {n}: {e}" for n, e in refused.items()))
        names = [w.name for role in ("data", "trainer", "rollout") for w in self.fleet.of_role(role)]
        hint = loopback_hint(self.cfg.cluster, self.partitions.values())
        if hint:
            self.progress.note(f"{hint} (harmless where Slurm runs on this host alone)")
        with self.progress.waiting(f"waiting for {len(self.workers)} workers to join"):
            self.placement.wait_workers(names, self.fleet.listed_states, self.fleet.log_of, hint)

    def _partition_of(self, worker: str) -> Partition:
        return self.partitions[self.workers[worker].partition]

    def _check_partition(self, part: Partition) -> None:
        """``ValueError`` when the run cannot start ``part`` (one added mid-run included): settings
        that do not fit the run's config, a ``vllm`` engine without vLLM in this environment (the
        one the run's workers start in) or with a ``max_model_len`` past a policy's model: its
        nodes would fail at every start."""
        self.cfg.check_added(part, self._episode_tokens)
        if part.role != "rollout" or effective_rollout(self.cfg.rollout, part).engine.type != "vllm":
            return
        from astraflow.rollout.vllm_setup import require_vllm

        require_vllm(f"partitions[{part.name}].rollout.engine.type")
        limit = engine_limit(self.cfg, part)
        for whose, (allowed, positions) in self._limits.items():
            if limit is not None:
                check_engine_positions(self.cfg, allowed, positions, whose, [limit])

    def _place_node(self, name: str, part: Partition):
        kwargs = node_kwargs(self.cfg, self.paths, name, part, self.dl)
        actor = RaaSNodeGroup if kwargs["rollout"].nodes_per_worker > 1 else RaaSNode
        return self.placement.submit_actor(actor, name, **kwargs)

    def _place_core(self) -> None:
        """Data layer first (the others get its handle), then trainers and RaaS nodes, all
        constructed and started concurrently (model loading dominates start-up)."""
        cfg, placement = self.cfg, self.placement
        data_w = self.fleet.of_role("data")[0]
        trainer_ws = self.fleet.of_role("trainer")
        with self.progress.waiting("placing the data layer"):
            self.fleet.dl = placement.wait_all("placing the data layer", {"data": placement.submit_actor(
                DataLayer, data_w.name, **data_layer_kwargs(cfg, self.paths))}, reads_data=True)["data"]
            data_w.actor = self.dl
            self._recover_served()
        on = self.restarts.placed_on = {p.name: trainer_ws[i % len(trainer_ws)].name
                                        for i, p in enumerate(cfg.policies)}
        placed = {pol.name: placement.submit_actor(Trainer, on[pol.name], **trainer_kwargs(
            cfg, self.paths, i, pol, self.dl, self._partition_of(on[pol.name]))) for i, pol in enumerate(cfg.policies)}

        def place_nodes() -> None:  # once the trainers are starting: the core workers serve
            for w in trainer_ws + [data_w]:
                if not w.gone:  # (a trainer worker lost and replaced already)
                    w.enter("serving", None)
            self.fleet.place_nodes(wait=True)

        with self.progress.waiting(f"starting {len(placed)} trainer(s) and the RaaS nodes (model loading)"):
            self.fleet.advance()  # the RaaS nodes' placing begins now: their loading overlaps the trainers'
            self.restarts.start_all(placed, place_nodes)  # a trainer worker lost meanwhile is replaced

    def _recover_served(self) -> None:
        """A resumed run: each trainer starts from its newest committed version; the data
        layer records the versions committed but never reported and puts back the batches
        served after them (what a restarted trainer gets, ``DataLayer.trainer_restarted``).
        What the previous incarnation's publishers left half-written or half-deleted, and the
        holds of its readers, are removed first: no publisher or reader is alive here (`launch`
        holds the run lock and cancelled the previous incarnation's jobs; this one's trainers
        and RaaS nodes are not placed yet)."""
        store = WeightStore(self.paths.weights, keep_last=self.cfg.storage.keep_versions)
        for pol in self.cfg.policies:
            dropped = store.discard_uncommitted(pol.name)
            if dropped:
                note(self.progress, self.paths, f"policy {pol.name}: removed versions v{dropped} a previous "
                                                "incarnation left uncommitted or half-deleted")
            store.discard_holds(pol.name)
            latest = store.latest(pol.name)
            if latest is not None:
                self.dl.trainer_restarted(pol.name, latest.version, restart=False).result(timeout=60)
        self.dl.resume_evaluation().result(timeout=60)  # at the versions the trainers resume from
        # the evaluations the last run printed
        self.progress.evals_shown(self.dl.state(TICK_EVALS).result(timeout=60).get("eval", []))

    # ------------------------------------------------------------------ the watch loop
    def _tick(self) -> Tick:
        """The data layer's and every trainer's state, read once for this tick. A component that
        does not answer is most often a lost worker: ``RunFailed`` then names it; a Dask
        scheduler that is gone is seen first (a call would wait for its reconnect)."""
        if (gone := self.placement.scheduler_gone()) is not None:
            raise SchedulerLost(gone)
        asking, worker = "the data layer", None
        try:
            # the newest evaluations only: a tick shows those, and the history grows with every round
            dl_state = self.dl.state(TICK_EVALS).result(timeout=30)
            read_at = time.time()
            trainers = {}
            for p, t in self.trainers.items():
                asking, worker = f"the trainer of {p}", self.restarts.placed_on.get(p)
                trainers[p] = t.state().result(timeout=30)
            return Tick(data_layer=dl_state, trainers=trainers, read_at=read_at)
        except FUTURE_ERRORS as err:
            self.fleet.check_core(wait_s=10.0)  # a lost worker: its own error (restarts follow)
            if isinstance(err, TimeoutError):  # its worker is there, it does not answer: hung, replaced
                why = f"{asking} did not answer within 30 s, its worker still connected (hung: see its log under jobs/)"
                hung(self.fleet, worker, why)
                raise RunFailed(f"{why}; `astraflow run` on the run directory resumes it") from err
            raise

    def _show(self, tick: Tick) -> None:
        self.last_tick = tick
        self.progress.update(tick)
        for warning in self.disk.sample():
            note(self.progress, self.paths, f"warning: {warning}")
        self.status.write(tick)

    def _loop(self, t0: float) -> None:
        if self.cfg.run.mode == "sync":
            self._sync_loop(t0)  # then the watch loop below sees the trainers done and the last evaluation out
        final = self.cfg.run.max_steps
        eval_on = bool(self.cfg.workload.eval.every)
        eval_waited = False
        while True:
            try:
                tick = self._tick()
                for p, st in tick.trainers.items():
                    if st["error"]:
                        self.restarts.backend_lost(p, st)  # a rank killed: TrainerLost, restarted below
                        raise full_disk_of(st) or RunFailed(f"trainer {p} failed: {st['error']}")
                if why := rule_failed(tick.data_layer):  # before nodes are replaced for it
                    raise RunFailed(why)
                self._reconcile()
                self.fleet.advance()
                self.fleet.replace_failed_nodes(tick.data_layer, silent_after=self.cfg.dataflow.lease_seconds)
                why = (self.parts.rollout_exhausted(self.fleet)
                       or self.nothing_completes.check_layer(tick.data_layer))
                if why:
                    raise RunFailed(why)
            except TrainerLost as lost:
                self._replace_trainer(lost)
                continue
            except DataLayerLost as lost:
                with self.status.alive_while(f"re-placing the data layer ({lost.why})"):
                    self.dl_restarts.replace(lost)  # or RunFailed: restarts spent, state not durable
                continue
            self.status.track(tick)
            if self.autoscaler is not None:
                self.autoscaler.step(tick)
            self._show(tick)
            done = all(st["done"] for st in tick.trainers.values())
            if done and (not eval_on or self.dl.eval_done(final).result(timeout=30)):
                return
            if done and not eval_waited:
                eval_waited = True
                self.progress.note(f"trainers took {final} steps; waiting for the held-out evaluation of v{final}")
            if time.time() - t0 > self.cfg.run.timeout_s:
                raise RunFailed(deadline_reason(self.cfg, tick.data_layer))
            time.sleep(1.0)

    def _replace_trainer(self, lost: TrainerLost) -> None:
        """The lost trainer replaced (or RunFailed: its restarts spent, its backend cannot resume)."""
        with self.status.alive_while(f"replacing the trainer worker {lost.worker.name} ({lost.why})"):
            self.restarts.replace(lost)

    def _sync_loop(self, t0: float) -> None:
        """The trainer-centred baseline: a driver loop owns the phases (see sync_driver)."""
        from astraflow.runtime.sync_driver import drive_sync

        last_tick, last_dl = 0.0, None

        def tick() -> None:
            nonlocal last_tick, last_dl
            if time.time() - t0 > self.cfg.run.timeout_s:  # the whole run's, as in the asynchronous loop
                raise RunFailed(deadline_reason(self.cfg, last_dl))
            if time.time() - last_tick > 1.0:
                last_tick = time.time()
                try:
                    t = self._tick()
                except TrainerLost as lost:  # between two steps, while a batch fills: replaced as in a step
                    self._replace_trainer(lost)
                    return
                last_dl = t.data_layer
                self.fleet.raise_full_disk(t.data_layer)  # nodes are not replaced here, but a full disk stops the run
                why = rule_failed(t.data_layer) or self.nothing_completes.check_layer(t.data_layer)
                if why:
                    raise RunFailed(why)
                self._show(t)

        def recover(policy: str, err: BaseException) -> bool:
            """After a trainer's step failed: replace a lost trainer or backend process (True), or False."""
            try:
                self.restarts.check_step_failure(policy, err)
            except TrainerLost as lost:
                self._replace_trainer(lost)
                return True
            return False

        cfg = self.cfg
        try:
            self.iterations = drive_sync(
                self.dl, self.trainers, self.fleet.serving_nodes,
                cfg.dataflow.batch_size, cfg.dataflow.batch_size // cfg.workload.group_size,
                cfg.run.max_steps, cfg.run.timeout_s - (time.time() - t0), tick, recover,
            )
        except (DataLayerLost, *FUTURE_ERRORS) as err:
            if time.time() - t0 > cfg.run.timeout_s:  # a phase that waited out the run's deadline
                raise RunFailed(deadline_reason(cfg, last_dl)) from err
            lost = err
            if not isinstance(err, DataLayerLost):
                try:
                    self.fleet.check_core(wait_s=10.0)  # a lost data layer names itself
                except DataLayerLost as found:
                    lost = found
                else:
                    raise
            # the driver holds the data layer's handle through its phases: no re-placing under it
            raise RunFailed(f"{lost}; run.mode: sync does not re-place a lost data layer: run again on this "
                            "run directory to resume it") from err


def _disk_advice(cfg: RunConfig) -> str:
    """What a warning of a filling disk says to do: trajectories the run is done with can go
    only from its own store."""
    if cfg.storage.keep_trajectories and not cfg.storage.trajectories:
        return ("free space there, or stop the run and resume it with storage.keep_trajectories: false "
                "(trajectory segments the run is done with are then deleted)")
    return "free space there"
