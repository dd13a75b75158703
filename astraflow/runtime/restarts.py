"""Runtime room: a lost trainer or data-layer worker is replaced and the run goes on.

When `Fleet` notices a trainer worker gone (its job ended, it left the Dask scheduler) it raises
`TrainerLost`; the orchestrator hands it to `TrainerRestarts.replace`, which, for every policy
whose trainer ran on that worker, while ``cluster.trainer_restarts`` allows:

1. cancels the lost worker's job (a worker that only left the scheduler must not publish again);
2. reads the newest committed version ``V`` of the policy and removes what the dead trainer
   left half-published or half-deleted (`WeightStore.discard_uncommitted`);
3. tells the data layer (`DataLayer.trainer_restarted`): versions up to ``V`` it committed but
   never reported are recorded, batches served at ``V`` or later return to the buffer, so
   nothing is dropped as ``served_not_trained`` and nothing is trained twice;
4. submits a new worker to the trainer partition (the reconciler refills it), waits for it to
   join, places a `Trainer` with the same arguments and starts it: it resumes from ``V`` and
   the newest optimiser checkpoint, which may be older than ``V`` (the gap is noted, logged and
   recorded: those moments lag the weights by that many steps);
5. swaps the handle in the orchestrator's ``trainers`` (the dict the sync driver holds too).

The orchestrator's loop waits while this happens (RaaS nodes keep generating). When the
restarts of a policy are spent, or its backend cannot resume, the run fails on its one way
out with a line naming why and the fix.

A lost data-layer worker (`DataLayerRestarts`, ``cluster.data_layer_restarts`` times): its job
is cancelled, a new worker is submitted to the data partition, and a `DataLayer` is built there
from the lost one's durable state (``dataflow/durable.py``: everything it had answered, leases
kept), then handed to every trainer and RaaS node (``reconnect``). They are told of the loss
first (``data_layer_lost``), so their calls meanwhile wait for it (``transport.Link``, up to
its ``reconnect_s``) even past their own deadlines, and are made again on it; it recognises
repeats.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from astraflow.dataflow.layer import DataLayer
from astraflow.runtime.placement import data_layer_kwargs, trainer_kwargs
from astraflow.runtime.workers import (FUTURE_ERRORS, NODE_PHASES, DataLayerLost, LostBeforeReady, RunFailed,
                                      TrainerLost)
from astraflow.training.backend import BackendProcessLost
from astraflow.training.trainer import Trainer
from storage.weights import WeightStore

if TYPE_CHECKING:
    from astraflow.config import RunConfig
    from astraflow.runtime.placement import Placement
    from astraflow.runtime.progress import Progress
    from astraflow.runtime.workers import Fleet
    from storage.paths import RunPaths

log = logging.getLogger("astraflow.runtime")



def optimizer_gap(state: dict[str, Any], version: int) -> str:
    """Which optimiser state a trainer at ``version`` goes on with, from its ``state()``, and the
    weights: the published ones rounded to their dtype when no checkpoint held the fp32 masters."""
    opt = state.get("optimizer_resumed_from")
    if opt is None:
        why = state.get("optimizer_fresh_why") or "no usable checkpoint: the trainer's log says why"
        text = f"a fresh optimiser state ({why})"
    else:
        text = f"the optimiser state of v{opt}" + (f" ({version - opt} steps older than its weights)"
                                                   if opt != version else "")
    if state.get("resumed_from_rounded"):
        text += ", from its published weights rounded to their publish dtype (no fp32 master weights of this version)"
    return text


def hung(fleet: Fleet, worker: str | None, why: str) -> None:
    """A data-layer or trainer worker that is connected but does not answer (stuck, or paused
    with SIGSTOP) is lost as one that vanished: ``TrainerLost`` / ``DataLayerLost``, so its
    restart cancels its job (SIGKILL reaches a stopped process) and replaces it. ``worker``: the
    trainer's worker name, None for the data layer's. Returns when no such worker is known."""
    found = fleet.workers.get(worker) if worker else next(
        (w for w in fleet.of_role("data") if not w.gone), None)
    if found is not None and not found.gone:
        fleet.lost(found, why)


class TrainerRestarts:
    """Which worker each policy's trainer runs on, and its restarts (shown in status.json and
    summary.json as ``trainer_restarts``)."""

    def __init__(self, cfg: RunConfig, paths: RunPaths, fleet: Fleet, placement: Placement, progress: Progress,
                 trainers: dict[str, Any], reconcile: Callable[[], None]):
        self.cfg, self.paths, self.fleet, self.placement, self.progress = cfg, paths, fleet, placement, progress
        #: the orchestrator's handles by policy, swapped in place
        self.trainers = trainers
        self.reconcile = reconcile
        #: policy -> name of the worker its trainer runs on
        self.placed_on: dict[str, str] = {}
        #: policy -> one record per restart (worker lost, why, new worker, versions)
        self.history: dict[str, list[dict[str, Any]]] = {p.name: [] for p in cfg.policies}

    def record(self) -> dict[str, Any]:
        """``{policy: {"count": n, "limit", "worker": the worker its trainer runs on, "restarts":
        [...]}}`` for status.json and summary.json."""
        return {p: {"count": len(h), "limit": self.cfg.cluster.trainer_restarts, "worker": self.placed_on.get(p),
                    "restarts": list(h)} for p, h in self.history.items()}

    def start_all(self, placed: dict[str, Any], meanwhile: Callable[[], None]) -> None:
        """The run's start: wait for the trainers ``placed`` (policy -> future of its actor),
        start each (backend build, v0 publish), run ``meanwhile`` until it completes once (the RaaS
        nodes' placing, which overlaps the trainers' model loading) and wait for the starts. A trainer worker
        lost meanwhile is replaced as one lost later in the run (``replace``, within
        ``cluster.trainer_restarts``); the other workers' trainers are still waited for."""
        run_loop = self.cfg.run.mode == "async"
        starts: dict[str, Any] = {}
        ran = False
        while True:
            try:
                waiting = {p: f for p, f in placed.items() if p not in starts}
                for p, t in self.placement.wait_all("placing trainers", waiting).items():
                    self.trainers[p] = t
                    starts[p] = t.start(run_loop=run_loop)
                if not ran:  # again after a replacement that interrupted it
                    meanwhile()
                    ran = True
                versions = self.placement.wait_all("starting trainers (backend build, v0 publish)", starts)
                self._note_resumed(versions)
                return
            except FUTURE_ERRORS as err:
                lost = self._lost_at_start(err)
            gone = lost.worker.name
            moved = [p for p, name in self.placed_on.items() if name == gone]
            self.replace(lost)  # places and starts the trainers of ``moved`` on a new worker
            for p in moved:
                placed.pop(p, None)
                starts.pop(p, None)

    def check_step_failure(self, policy: str, err: BaseException) -> None:
        """After ``policy``'s step driven from outside (``run.mode: sync``) raised ``err``: raise
        ``TrainerLost`` when its backend lost a process (``backend_lost``) or its worker is gone."""
        if isinstance(err, BackendProcessLost):
            self.backend_lost(policy, {"error_lost": True, "error": f"{type(err).__name__}: {err}"})
        self.fleet.check_core(wait_s=10.0)

    def _lost_at_start(self, err: BaseException) -> TrainerLost:
        """The trainer worker lost behind ``err``, raised at the run's start; else ``err`` again
        (an actor's own error, the data layer's worker lost: the run fails on it)."""
        if isinstance(err, TrainerLost):
            return err
        if isinstance(err, (LostBeforeReady, OSError)):  # the job's end may be seen a little later
            try:
                self.fleet.check_core(wait_s=10.0)
            except TrainerLost as lost:
                return lost
        raise err

    def backend_lost(self, policy: str, state: dict[str, Any]) -> None:
        """Raise ``TrainerLost`` for the worker of ``policy``'s trainer when it failed because a
        process of its backend was killed from outside (``error_lost``: a Megatron rank ended by
        the out-of-memory killer): its worker is then replaced and the trainer restarted as
        after a lost worker (``replace``). Nothing for any other failure."""
        w = self.fleet.workers.get(self.placed_on.get(policy, ""))
        if not state.get("error_lost") or w is None or w.gone:
            return
        why = state["error"].splitlines()[0]
        w.enter("gone")  # its job is cancelled and the partition refilled, as for a worker that vanished
        w.note = why
        raise TrainerLost(f"trainer {policy} on worker {w.name} lost a process of its backend ({why})", w, why)

    def replace(self, lost: TrainerLost) -> None:
        """Restart every trainer that ran on the lost worker (module docstring), or raise
        ``RunFailed`` saying why it cannot be and the fix."""
        w, why = lost.worker, lost.why
        policies = [p for p, name in self.placed_on.items() if name == w.name]
        limit = self.cfg.cluster.trainer_restarts
        for p in policies:
            if limit == 0:
                raise RunFailed(f"{lost}; restarting its trainer ({p}) is off (cluster.trainer_restarts: 0): "
                                "set it above 0 to restart a lost trainer, or run again on this run directory")
            if len(self.history[p]) >= limit:
                raise RunFailed(f"{lost}; trainer {p} was already restarted {limit} time(s), the limit "
                                f"(cluster.trainer_restarts: {limit}): raise it, or find why its workers die")
        try:
            # it may only have left the scheduler: it must not publish again once the store is read
            self.fleet.parts.cancel(w, wait=True)
        except Exception as err:  # the job is most often gone already
            log.warning("cancelling the lost trainer worker %s failed: %s", w.name, err)
        if not policies:  # a trainer worker that held no trainer: the reconciler refills it
            self.progress.note(f"trainer worker {w.name} is gone ({why}); it held no trainer")
            return
        store = WeightStore(self.paths.weights, keep_last=self.cfg.storage.keep_versions)
        started: dict[str, dict[str, Any]] = {}
        for p in policies:  # the RaaS nodes' holds stay: they are live readers (unlike at a resume)
            latest = store.latest(p)
            version = latest.version if latest is not None else 0
            dropped = store.discard_uncommitted(p)
            back = self.fleet.dl.trainer_restarted(p, version).result(timeout=60)
            n = len(self.history[p]) + 1
            started[p] = {"worker": w.name, "why": why, "at": time.time(), "from_version": version,
                          "discarded_versions": dropped, "put_back": back["put_back"],
                          "recovered_versions": back["recovered"]}
            self._note(
                f"trainer {p} lost ({why}): restarting it ({n} of {limit}) from v{version}; "
                f"{back['put_back']} sequences served to it put back"
                + _discarded(dropped, version))
        new = self._new_worker(w.partition, why)
        index = {pol.name: i for i, pol in enumerate(self.cfg.policies)}
        pols = {pol.name: pol for pol in self.cfg.policies}
        try:
            with self.progress.waiting(f"restarting trainer(s) {', '.join(policies)} on {new.name}"):
                placed = self.placement.wait_all("placing the restarted trainer", {
                    p: self.placement.submit_actor(Trainer, new.name, **trainer_kwargs(
                        self.cfg, self.paths, index[p], pols[p], self.fleet.dl,
                        self.fleet.parts.partitions[new.partition])) for p in policies})
                starts = {p: t.start(run_loop=self.cfg.run.mode == "async") for p, t in placed.items()}
                versions = self.placement.wait_all("starting the restarted trainer", starts)
                states = {p: t.state().result(timeout=30) for p, t in placed.items()}
        except RunFailed:
            raise
        except Exception as err:  # the actor's error: e.g. a backend that cannot resume
            raise RunFailed(f"{lost}; restarting trainer(s) {', '.join(policies)} failed: "
                            f"{type(err).__name__}: {err}") from None
        new.enter("serving")
        for p, t in placed.items():
            self.trainers[p] = t
            self.placed_on[p] = new.name
            opt = states[p].get("optimizer_resumed_from")
            self.history[p].append({**started[p], "new_worker": new.name, "resumed_version": versions[p],
                                    "optimizer_version": opt,
                                    "optimizer_gap": None if opt is None else versions[p] - opt})
            self._note(f"trainer {p} restarted on {new.name} at v{versions[p]} with "
                       f"{optimizer_gap(states[p], versions[p])}")

    def _note_resumed(self, versions: dict[str, int]) -> None:
        """At a resumed run's start, say per trained policy which optimiser state its trainer goes on
        with: older moments or fresh ones change the next steps, and the trainer's log is not the console."""
        for p, version in versions.items():
            if not version or self.cfg.policy(p).trainer.backend == "sim":  # a new run's v0; no optimiser
                continue
            try:
                state = self.trainers[p].state().result(timeout=30)
            except Exception:  # a worker lost meanwhile: the loop's next tick finds it
                continue
            self._note(f"trainer {p} resumes at v{version} with {optimizer_gap(state, version)}")

    def _note(self, msg: str) -> None:
        note(self.progress, self.paths, msg)

    def _new_worker(self, partition: str, why: str):
        return new_worker(self, "trainer", partition, why)


def _discarded(versions: list[int], latest: int) -> str:
    """What a restart's note says of the version directories it removed: above ``latest`` a
    publish the lost trainer did not finish; below it one that retention had begun to delete."""
    said = []
    if newer := [v for v in versions if v > latest]:
        said.append("uncommitted " + ", ".join(f"v{v}" for v in newer) + " discarded")
    if older := [v for v in versions if v <= latest]:
        said.append("half-deleted old " + ", ".join(f"v{v}" for v in older) + " removed (retention)")
    return "".join(f"; {x}" for x in said)


def note(progress: Progress, paths: RunPaths, msg: str) -> None:
    """In the progress and in ``logs/orchestrator.log`` (the terminal of a quiet run stays for
    the one line a run ends with)."""
    progress.note(msg)
    log.info(msg)
    with contextlib.suppress(OSError), open(paths.log("orchestrator"), "a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}\n")


def new_worker(r: TrainerRestarts | DataLayerRestarts, role: str, partition: str, why: str):
    """Submit a worker to the lost one's partition and wait until it joined."""
    before = set(r.fleet.workers)
    r.reconcile()
    fresh = [x for x in r.fleet.in_partition(partition) if x.name not in before and not x.gone]
    if not fresh:
        ps = r.fleet.parts.state[partition]
        raise RunFailed(f"{role} worker lost ({why}) and no new worker could be submitted to partition "
                        f"{partition}: {ps.error or ps.state}; see {r.paths.jobs}")
    new = fresh[0]
    with r.progress.waiting(f"waiting for the new {role} worker {new.name}"):
        r.placement.wait_workers([new.name], r.fleet.listed_states, r.fleet.log_of)
    new.joined_at = time.time()
    return new


class DataLayerRestarts:
    """Re-places a lost data layer (module docstring); its restarts are shown in status.json
    and summary.json as ``data_layer_restarts``."""

    def __init__(self, cfg: RunConfig, paths: RunPaths, fleet: Fleet, placement: Placement, progress: Progress,
                 trainers: dict[str, Any], reconcile: Callable[[], None]):
        self.cfg, self.paths, self.fleet, self.placement, self.progress = cfg, paths, fleet, placement, progress
        self.trainers = trainers
        self.reconcile = reconcile
        self.history: list[dict[str, Any]] = []

    def record(self) -> dict[str, Any]:
        return {"count": len(self.history), "limit": self.cfg.cluster.data_layer_restarts,
                "restarts": list(self.history)}

    def _tell_holders(self, what: str, call: Callable[[Any], Any], timeout: float) -> tuple[list[str], list[str]]:
        """``call`` on every trainer and RaaS node actor (each holds a link to the data layer),
        then wait for them all: the components called, and those that could not be told (a node
        that cannot be told is replaced when it goes silent)."""
        holders = {f"trainer {p}": t for p, t in self.trainers.items()}
        holders.update({f"node {x.name}": x.actor for x in self.fleet.workers.values()
                        if self.fleet.role(x) == "rollout" and x.phase in NODE_PHASES and x.actor is not None})
        calls, missed = {}, []
        for k, h in holders.items():
            try:
                calls[k] = call(h)
            except FUTURE_ERRORS as err:
                missed.append(k)
                log.warning("%s %s failed: %s", what, k, err)
        deadline = time.monotonic() + timeout  # one deadline for all: a stuck holder costs it once
        for k, fut in calls.items():
            try:
                fut.result(timeout=max(deadline - time.monotonic(), 0.5))
            except FUTURE_ERRORS as err:
                missed.append(k)
                log.warning("%s %s failed: %s", what, k, err)
        return list(holders), missed

    def replace(self, lost: DataLayerLost) -> None:
        """Re-place the data layer on a new worker and reconnect everyone to it, or raise
        ``RunFailed`` saying why it cannot be and the fix."""
        w, why = lost.worker, lost.why
        limit = self.cfg.cluster.data_layer_restarts
        if not self.cfg.dataflow.durable:
            raise RunFailed(f"{lost}; its state is not saved (dataflow.durable: false), so it cannot be re-placed: "
                            "turn it on, or run again on this run directory")
        if limit == 0 or len(self.history) >= limit:
            raise RunFailed(f"{lost}; the data layer was already re-placed {len(self.history)} time(s), the limit "
                            f"(cluster.data_layer_restarts: {limit}): raise it, or find why its workers die")
        t0 = time.time()
        try:
            # it may only have left the scheduler: it must not answer or write again once re-placed
            self.fleet.parts.cancel(w, wait=True)
        except Exception as err:  # the job is most often gone already
            log.warning("cancelling the lost data-layer worker %s failed: %s", w.name, err)
        n = len(self.history) + 1
        note(self.progress, self.paths, f"data layer lost ({why}): re-placing it ({n} of {limit}) from its saved state")
        # their calls to it wait for the new one past their own deadlines (a Slurm queue)
        self._tell_holders("data_layer_lost", lambda h: h.data_layer_lost(), timeout=10)
        self.fleet.forget_silence()  # nobody could call the lost one: no node's silence counts
        new = new_worker(self, "data-layer", w.partition, why)
        try:
            with self.progress.waiting(f"restoring the data layer on {new.name}"):
                dl = self.placement.wait_all("placing the re-placed data layer", {"data": self.placement.submit_actor(
                    DataLayer, new.name, **data_layer_kwargs(self.cfg, self.paths, keep_leases=True))},
                    reads_data=True)["data"]
                restored = dl.state().result(timeout=60).get("restored") or {}
        except RunFailed:
            raise
        except Exception as err:  # the actor's error: e.g. a snapshot it cannot use
            raise RunFailed(f"{lost}; re-placing the data layer failed: {type(err).__name__}: {err}") from None
        self.fleet.dl = new.actor = dl
        new.enter("serving")
        calls, missed = self._tell_holders("reconnecting", lambda h: h.reconnect(dl), timeout=30)
        self.history.append({"worker": w.name, "why": why, "at": t0, "new_worker": new.name,
                             "seconds": time.time() - t0, "restored": restored, "not_reconnected": missed})
        note(self.progress, self.paths,
             f"data layer restored on {new.name} in {time.time() - t0:.0f}s: {restored.get('open_tasks', 0)} open "
             f"tasks, {restored.get('leases_kept', 0)} leases kept, {restored.get('buffered', 0)} sequences "
             f"buffered; {len(calls) - len(missed)} of {len(calls)} components reconnected")
