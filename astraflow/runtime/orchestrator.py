"""Runtime room: the orchestrator, the thin owner of a run's loop. It owns no training logic
and delegates each concern to its own module:

* bring-up and placement (`placement`): the Dask scheduler, actors on named workers, deadlines;
* the worker state machine (`workers`): phases, losses, failed nodes, removals and drains;
* partition reconciliation (`reconcile`): desired partitions against the worker jobs;
* status and summary (`monitoring.writer`): ``control/status.json`` each tick, ``summary.json``.

Each tick of its loop it:

1. reads the *desired* partitions and submits or cancels worker jobs to match;
2. advances every worker one step: places a RaaS actor on every rollout worker that joined
   and has none (the node catches up to the latest weights before leasing), and tells the data
   layer about workers that vanished (their leases are requeued at once instead of waiting for
   expiry);
3. shows progress and writes the status, and ends the run when every trainer took its steps
   and the last evaluation finished (or on Ctrl-C / a component error / the run deadline).

Shutdown of a run that ends or is interrupted goes in this order: RaaS nodes drain and flush
(nothing written is lost), trainers stop, the data layer ends every open task in the ledger and
closes ``metrics.jsonl``, worker jobs are cancelled by id, the scheduler process is stopped by
pid. A run that fails (a component error, a deadline) raises at once, after only the last two.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astraflow.config import RunConfig, dump_config
from astraflow.dataflow.layer import DataLayer
from astraflow.rollout.node import RaaSNode
from astraflow.runtime.control import write_desired
from astraflow.runtime.monitoring import StatusWriter, Tick, archive_summary
from astraflow.runtime.placement import Placement, data_layer_kwargs, node_kwargs, trainer_kwargs
from astraflow.runtime.progress import Progress
from astraflow.runtime.reconcile import PartitionSet, run_tag
from astraflow.runtime.workers import FUTURE_ERRORS, NODE_PHASES, PHASES, Fleet, RunFailed, Worker
from astraflow.training.trainer import Trainer
from schedulers import Partition
from storage.paths import RunPaths

__all__ = ["PHASES", "Orchestrator", "RunFailed", "RunResult", "Worker"]

log = logging.getLogger("astraflow.runtime")


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
        self.placement = Placement(self.paths, cfg.cluster, self.progress)
        self.parts = PartitionSet(list(cfg.partitions), self.paths, cfg.cluster, self.progress)
        self.fleet = Fleet(self.parts, self.placement, cfg.cluster, self.progress, self._place_node)
        self.status = StatusWriter(self.paths, self.run_tag(), self.parts, self.fleet)
        self.trainers: dict[str, Any] = {}
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
        t0 = time.time()
        interrupted = False
        archive_summary(self.paths)  # resuming a finished run: keep its old summary aside
        dump_config(self.cfg, self.paths.config)
        write_desired(self.paths, list(self.partitions.values()))
        try:
            self._bring_up()
            self._place_core()
            self._loop(t0)
        except KeyboardInterrupt:
            interrupted = True
            self.progress.note("interrupted: stopping cleanly (nodes flush what they wrote)")
        except BaseException:  # a failed run still cancels its worker jobs and stops its scheduler
            self._teardown_quietly()
            raise
        try:
            result = self._shutdown(t0, interrupted)
        finally:
            self._teardown()
        return result

    # ------------------------------------------------------------------ bring-up
    def _reconcile(self) -> None:
        self.parts.reconcile(self.fleet, self.placement.scheduler_address)

    def _bring_up(self) -> None:
        """Start the scheduler, submit every configured worker job, wait until all joined."""
        self.placement.start()
        self._reconcile()
        refused = self.parts.refused()
        if refused:
            raise RunFailed("; ".join(f"partition {n}: {e}" for n, e in refused.items()))
        names = [w.name for role in ("data", "trainer", "rollout") for w in self.fleet.of_role(role)]
        with self.progress.waiting(f"waiting for {len(self.workers)} workers to join"):
            self.placement.wait_workers(names, self.fleet.listed_states)

    def _place_node(self, name: str, part: Partition):
        return self.placement.submit_actor(RaaSNode, name, **node_kwargs(self.cfg, self.paths, name, part, self.dl))

    def _place_core(self) -> None:
        """Data layer first (the others get its handle), then trainers and RaaS nodes, all
        constructed and started concurrently (model loading dominates start-up)."""
        cfg, placement = self.cfg, self.placement
        data_w = self.fleet.of_role("data")[0]
        trainer_ws = self.fleet.of_role("trainer")
        with self.progress.waiting("placing the data layer"):
            self.fleet.dl = placement.wait_all("placing the data layer", {"data": placement.submit_actor(
                DataLayer, data_w.name, **data_layer_kwargs(cfg, self.paths))})["data"]
            data_w.actor = self.dl
        placed = {
            pol.name: placement.submit_actor(Trainer, trainer_ws[i % len(trainer_ws)].name,
                                             **trainer_kwargs(cfg, self.paths, i, pol, self.dl))
            for i, pol in enumerate(cfg.policies)
        }
        with self.progress.waiting(f"starting {len(placed)} trainer(s) and the RaaS nodes (model loading)"):
            self.trainers = placement.wait_all("placing trainers", placed)
            starts = {p: t.start(run_loop=cfg.run.mode == "async") for p, t in self.trainers.items()}
            for w in trainer_ws + [data_w]:
                w.enter("serving", None)
            self.fleet.place_nodes(wait=True)
            placement.wait_all("starting trainers (backend build, v0 publish)", starts)

    # ------------------------------------------------------------------ the watch loop
    def _tick(self) -> Tick:
        """The data layer's and every trainer's state, read once for this tick."""
        return Tick(data_layer=self.dl.state().result(timeout=30),
                    trainers={p: t.state().result(timeout=30) for p, t in self.trainers.items()})

    def _show(self, tick: Tick) -> None:
        self.progress.update(tick)
        self.status.write(tick)

    def _loop(self, t0: float) -> None:
        if self.cfg.run.mode == "sync":
            self._sync_loop(t0)
        final = self.cfg.run.max_steps
        eval_on = bool(self.cfg.workload.eval.every)
        eval_waited = False
        while True:
            tick = self._tick()
            for p, st in tick.trainers.items():
                if st["error"]:
                    raise RunFailed(f"trainer {p} failed: {st['error']}")
            self._reconcile()
            self.fleet.advance()
            self.fleet.replace_failed_nodes(tick.data_layer)
            self.status.track(tick)
            self._show(tick)
            done = all(st["done"] for st in tick.trainers.values())
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

        last_tick = 0.0

        def tick() -> None:
            nonlocal last_tick
            if time.time() - last_tick > 1.0:
                last_tick = time.time()
                self._show(self._tick())

        cfg = self.cfg
        self.iterations = drive_sync(
            self.dl, self.trainers, self.fleet.serving_nodes,
            cfg.dataflow.batch_size, cfg.dataflow.batch_size // cfg.workload.group_size,
            cfg.run.max_steps, cfg.run.timeout_s, tick,
        )

    # ------------------------------------------------------------------ shutdown
    def _shutdown(self, t0: float, interrupted: bool) -> RunResult:
        nodes: dict[str, Any] = {}
        if self.dl is None:
            return RunResult(self.paths.root, {}, [], {}, time.time() - t0, interrupted)
        futures = {w.name: (w.future if w.draining else w.actor.stop(timeout=60)) for w in self.fleet.of_role("rollout")
                   if w.phase in NODE_PHASES and w.actor is not None}
        for n, f in futures.items():
            try:
                nodes[n] = f.result(timeout=120)
            except FUTURE_ERRORS as err:  # the worker died during shutdown: its leases end as run_ended
                nodes[n] = {"node": n, "error": f"{type(err).__name__}: {err}"}
        steps, trainers = {}, {}
        for p, t in self.trainers.items():
            trainers[p] = t.stop(timeout=120).result(timeout=150)
            steps[p] = trainers[p]["version"]
        ledger = self.dl.finish().result(timeout=60)
        state = self.dl.state().result(timeout=30)
        self.dl.close().result(timeout=30)
        result = RunResult(self.paths.root, steps, state["eval"], ledger, time.time() - t0, interrupted, nodes)
        self.status.write_summary(steps=steps, ledger=ledger, seconds=result.seconds, interrupted=interrupted,
                                  nodes=nodes, trainers=trainers, data_layer=state, iterations=self.iterations)
        return result

    def _teardown_quietly(self) -> None:
        """``_teardown`` on the way out of a failed run: its own errors are logged, so that the
        run's error is the one reported."""
        try:
            self._teardown()
        except Exception:
            log.exception("stopping the workers and the scheduler of a failed run")

    def _teardown(self) -> None:
        """Cancel every worker job still alive (by id) and stop the scheduler (by pid)."""
        if self.placement.client is not None:
            self.placement.client.close()
        for sched in self.parts.schedulers.values():
            sched.cancel([w.job.job_id for w in self.workers.values() if w.job.kind == sched.kind and not w.gone])
            sched.close()
        if self.placement.scheduler_proc is not None:
            self.placement.scheduler_proc.stop()
