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

Shutdown always runs, in this order: RaaS nodes drain and flush (nothing written is lost),
trainers stop, the data layer ends every open task in the ledger and closes ``metrics.jsonl``,
worker jobs are cancelled by id, the scheduler process is stopped by pid.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distributed import Client

from astraflow.config import RunConfig, dump_config
from astraflow.dataflow.layer import DataLayer
from astraflow.rollout.node import NodeIdentity, RaaSNode
from astraflow.runtime.cluster import SchedulerProcess, repo_root
from astraflow.runtime.control import write_json_atomic, write_orchestrator_info
from astraflow.runtime.progress import Progress
from astraflow.training.trainer import Trainer
from schedulers import JobRef, Partition, make_scheduler, parse_worker_name
from storage.paths import RunPaths

log = logging.getLogger("astraflow.runtime")


class RunFailed(RuntimeError):
    """A component reported an error or the run passed its deadline."""


@dataclass
class _Worker:
    job: JobRef
    partition: str
    actor: Any = None
    started: bool = False
    draining: bool = False
    gone: bool = False


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
        self.scheduler_proc = SchedulerProcess(self.paths, cc.dashboard_host, cc.dashboard_port)
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
        core = [w for w in self.workers.values() if self.partitions[w.partition].role in ("data", "trainer")]
        rollout = [w for w in self.workers.values() if self.partitions[w.partition].role == "rollout"]
        with self.progress.waiting(f"waiting for {len(self.workers)} workers to join"):
            self._wait_workers([w.job.worker_name for w in core + rollout], self.cfg.cluster.worker_start_timeout_s)

    def _scheduler_for(self, part: Partition):
        if part.scheduler not in self.schedulers:
            kwargs: dict[str, Any] = {"log_dir": self.paths.jobs} if part.scheduler == "local" else {"job_dir": self.paths.jobs}
            self.schedulers[part.scheduler] = make_scheduler(part.scheduler, **kwargs)
        return self.schedulers[part.scheduler]

    def _scheduler_address(self) -> str:
        return self.client.scheduler.address  # type: ignore[union-attr]

    def _reconcile(self) -> None:
        """Submit or cancel worker jobs so each desired partition has ``nodes`` live workers."""
        desired = read_desired(self.paths)
        for name, part in desired.items():
            self.partitions[name] = part
        for name, part in self.partitions.items():
            live = [w for w in self.workers.values() if w.partition == name and not w.gone and not w.draining]
            if name not in desired:
                for w in live:
                    self._remove_worker(w, drain=desired_removal_mode(self.paths, name) == "drain")
                continue
            missing = part.nodes - len(live)
            if missing > 0:
                used = {parse_worker_name(w.job.worker_name)["index"] for w in self.workers.values() if w.partition == name}
                start = max(used) + 1 if used else 0
                for job in self._scheduler_for(part).submit(part, self._scheduler_address(), missing, start):
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
        info = self.client.scheduler_info(n_workers=-1)["workers"]  # type: ignore[union-attr]
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
            data_w.actor, data_w.started = self.dl, True
        placed = {}
        for i, pol in enumerate(cfg.policies):
            w = trainer_ws[i % len(trainer_ws)]
            placed[pol.name] = self._submit_actor(
                Trainer, w.job.worker_name,
                policy=pol.name, cfg=pol.trainer, model_path=str(pol.model),
                weights_root=str(self.paths.weights), keep_versions=cfg.storage.keep_versions,
                data_layer=self.dl, max_steps=cfg.run.max_steps, seed=cfg.run.seed + i,
                write_deltas=cfg.storage.deltas,
            )
            w.started = True
        with self.progress.waiting(f"starting {len(placed)} trainer(s) and the RaaS nodes (model loading)"):
            self.trainers = self._wait_all("placing trainers", placed)
            starts = {p: t.start(run_loop=cfg.run.mode == "async") for p, t in self.trainers.items()}
            self._place_nodes()
            versions = self._wait_all("starting trainers (backend build, v0 publish)", starts)
        if cfg.workload.eval.every:  # the curve starts where training starts (0, or a resumed version)
            self.dl.start_eval(min(versions.values())).result(timeout=30)

    def _place_nodes(self) -> None:
        """Place and start a RaaS node on every rollout worker that joined and has none."""
        joined = self._joined()
        todo = {
            name: w for name, w in self.workers.items()
            if self.partitions[w.partition].role == "rollout" and not w.started and not w.gone and name in joined
        }
        if not todo:
            return
        actors = self._wait_all("placing RaaS nodes", {
            name: self._submit_actor(RaaSNode, name, **self._node_kwargs(name, self.partitions[w.partition]))
            for name, w in todo.items()
        })
        versions = self._wait_all("starting RaaS nodes (engine load, weight catch-up)",
                                  {name: a.start() for name, a in actors.items()})
        for name, w in todo.items():
            w.actor, w.started = actors[name], True
            self.progress.note(f"RaaS node {name} serving {versions[name]}")

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
            self._check_workers()
            self._reconcile()
            self._place_nodes()
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
                     if w.actor is not None and w.started and not w.gone and self.partitions[w.partition].role == "rollout"],
            cfg.dataflow.batch_size, cfg.dataflow.batch_size // cfg.workload.group_size,
            cfg.run.max_steps, cfg.run.timeout_s, tick,
        )

    def _write_status(self, state: dict[str, Any], trainers: dict[str, Any]) -> None:
        job_states = {}
        for sched in self.schedulers.values():
            job_states.update({j.job_id: j.state for j in sched.jobs()})
        write_json_atomic(self.paths.status_file, {
            "written_at": time.time(),
            "run_dir": str(self.paths.root),
            "data_layer": state,
            "trainers": trainers,
            "partitions": {
                n: {**p.model_dump(mode="json"),
                    "live": sum(1 for w in self.workers.values() if w.partition == n and not w.gone)}
                for n, p in self.partitions.items()
            },
            "workers": {
                n: {"job_id": w.job.job_id, "partition": w.partition, "kind": w.job.kind,
                    "state": "GONE" if w.gone else str(job_states.get(w.job.job_id, "UNKNOWN")),
                    "draining": w.draining, "actor": w.started}
                for n, w in self.workers.items()
            },
        })

    def _check_workers(self) -> None:
        """Notice workers that vanished (job failed or cancelled from outside)."""
        joined = self._joined()
        states = {}
        for sched in self.schedulers.values():
            states.update({j.job_id: j for j in sched.jobs()})
        for name, w in self.workers.items():
            if w.gone:
                continue
            st = states.get(w.job.job_id)
            ended = st is not None and not st.active
            if ended or (w.started and name not in joined):
                w.gone = True
                if self.partitions[w.partition].role == "rollout":
                    n = self.dl.node_gone(name).result(timeout=30)
                    self.progress.note(f"worker {name} is gone ({st.state if st else 'left'}); {n} leases requeued")
                else:
                    raise RunFailed(f"{self.partitions[w.partition].role} worker {name} is gone; see {w.job.log}")

    def _remove_worker(self, w: _Worker, drain: bool) -> None:
        name = w.job.worker_name
        w.draining = True
        if w.actor is not None and drain:
            self.dl.drain(name).result(timeout=30)
            w.actor.stop(timeout=60).result(timeout=90)
        self.dl.node_gone(name).result(timeout=30)
        self._scheduler_for(self.partitions[w.partition]).cancel([w.job.job_id])
        w.gone = True
        self.progress.note(f"removed worker {name} ({'drained' if drain else 'now'})")

    # ------------------------------------------------------------------ shutdown
    def _shutdown(self, t0: float, interrupted: bool) -> RunResult:
        nodes: dict[str, Any] = {}
        if self.dl is None:
            return RunResult(self.paths.root, {}, [], {}, time.time() - t0, interrupted)
        futures = {n: w.actor.stop(timeout=60) for n, w in self.workers.items()
                   if w.actor is not None and w.actor is not self.dl and not w.gone
                   and self.partitions[w.partition].role == "rollout"}
        for n, f in futures.items():
            nodes[n] = f.result(timeout=120)
        steps = {}
        for p, t in self.trainers.items():
            steps[p] = t.stop(timeout=120).result(timeout=150)["version"]
        ledger = self.dl.finish().result(timeout=60)
        state = self.dl.state().result(timeout=30)
        self.dl.close().result(timeout=30)
        result = RunResult(self.paths.root, steps, state["eval"], ledger, time.time() - t0, interrupted, nodes)
        self.paths.summary.write_text(
            json.dumps(
                {"steps": steps, "eval": state["eval"], "ledger": ledger, "seconds": result.seconds,
                 "interrupted": interrupted, "nodes": nodes, "data_layer": state,
                 "iterations": self.iterations,
                 "workers": {n: {"job_id": w.job.job_id, "partition": w.partition, "gone": w.gone,
                                 "served": w.started} for n, w in self.workers.items()}},
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


# -- desired partitions (written by the CLI, read by the orchestrator) ------------------------

def _desired_file(paths: RunPaths) -> Path:
    return paths.desired_partitions


def write_desired(paths: RunPaths, partitions: list[Partition], removals: dict[str, str] | None = None) -> None:
    data = {"partitions": [p.model_dump(mode="json") for p in partitions], "removals": removals or {}}
    tmp = _desired_file(paths).with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, _desired_file(paths))


def read_desired(paths: RunPaths) -> dict[str, Partition]:
    f = _desired_file(paths)
    if not f.exists():
        return {}
    data = json.loads(f.read_text())
    return {p["name"]: Partition.model_validate(p) for p in data["partitions"]}


def desired_removal_mode(paths: RunPaths, name: str) -> str:
    f = _desired_file(paths)
    if not f.exists():
        return "drain"
    return json.loads(f.read_text()).get("removals", {}).get(name, "drain")
