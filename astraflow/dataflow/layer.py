"""The data layer: the Dask actor that RaaS nodes and trainers meet through.

It never runs a model. RaaS nodes pull tasks with ``lease`` and report stored trajectories with
``complete``; trainers pull batches with ``next_batch`` and report new weight versions with
``published``. This module is the front: it keeps the public methods and wires the rooms that
own the state, each with its named asynchronous overlap:

* ``leases.py``: task queues, leases and the ledger hand-off (*lease expiry*);
* ``mixing.py``: per-source prompt orders, rollout-ahead shares and batch quotas (*rollout
  ahead of training*);
* ``buffers.py``: ingest of finished groups, per-policy buffers, replay and the batch itself,
  served by reference (*staleness*);
* ``serving.py``: the trainer-facing calls (batches served, versions committed, a trainer
  replaced: *served, then committed*);
* ``evals.py``: held-out evaluation rounds;
* ``record.py``: the metrics lines and the saved state;
* ``rules.py``: the dataflow rules (curator, group filter, ordering) run at their stages;
* ``durable.py``: the change log every call that changed the state writes to before it
  answers, and the ledger's journal (a re-placed or resumed data layer continues from them).

Every public method is ``async``: Dask runs async actor methods on the worker's event loop,
one at a time between awaits, so the state needs no locks, and a trainer blocked in
``next_batch`` does not block the leases that will fill its batch.
"""

from __future__ import annotations

import asyncio
import gc
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

from astraflow.contracts import RolloutTask, TrajectoryRef, lease_stock_name
from astraflow.lane import LaneServed
from astraflow.dataflow import admission, durable
from astraflow.dataflow import record as rec
from astraflow.dataflow import rules as R
from astraflow.dataflow.buffers import Buffers, RolloutGroup
from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.evals import EvalRounds
from astraflow.dataflow.leases import Leases
from astraflow.dataflow.mixing import Mixer, empty_train_split
from astraflow.dataflow.serving import BatchTimeout, TrainerFacing
from astraflow.transport import Packed, PackedDict
from astraflow.workloads.base import make_workload
from astraflow.workloads.config import WorkloadConfig
from storage.trajectories import open_trajectory_store

__all__ = ["BatchTimeout", "DataLayer"]


#: allocations between young-generation collections in the data layer's process (the default
#: is 700), and how many young collections come before a middle one (default 10)
GC_THRESHOLDS = (50_000, 20)
#: completions recorded before ``complete`` lets other calls run (a gathered completion of a
#: node group can carry thousands)
COMPLETE_SLICE = 64


def collect_less_often() -> None:
    """The data layer keeps a large heap that lives long (tasks, leases, buffers, the change
    log's shadow) and allocates fast on every call; with Python's default thresholds a full
    collection rescans that heap several times a second, which costs a large share of the
    layer's CPU and pauses every call behind it. Collecting after more allocations makes full
    collections rare; garbage that refcounting frees (nearly all of it) is unaffected, cycles
    wait longer. Never lowers thresholds set higher by the process."""
    g0, g1, g2 = gc.get_threshold()
    gc.set_threshold(max(g0, GC_THRESHOLDS[0]), max(g1, GC_THRESHOLDS[1]), g2)


class DataLayer(TrainerFacing, LaneServed):
    """Dask actor: owns tasks, leases, the trajectory index and the per-policy buffers."""

    #: the nodes' frequent calls, also served on the direct lane (``astraflow/lane.py``)
    LANE_METHODS = frozenset({"lease", "lease_many", "lease_ahead", "return_leases", "complete", "fail",
                              "heartbeat", "heartbeat_many", "progress"})

    def __init__(
        self,
        *,
        dataflow: DataflowConfig,
        workload: WorkloadConfig,
        policies: list[str],
        store_url: str,
        metrics_path: str | None,
        max_steps: int,
        seed: int = 0,
        gated: bool = False,
        state_path: str | None = None,
        snapshot_path: str | None = None,
        journal_path: str | None = None,
        keep_leases: bool = False,
    ):
        self.cfg = dataflow
        self.wcfg = workload
        collect_less_often()
        self.policy_names = list(policies)
        self.max_steps = max_steps
        #: the snapshot and journal; opened first: a restore cuts files back before they are appended to
        self.durability = durable.Durability(snapshot_path, journal_path, metrics_path, self.policy_names, workload)
        #: opened (created if new, its layout version checked) before any node writes; batches
        #: are served by reference, so the data layer itself reads no rows from it
        self.store = open_trajectory_store(store_url, "a")
        wl = make_workload(workload.name, workload.params, workload.seed)
        self._train = wl.tasks("train")
        if not self._train and max_steps > 0:
            raise ValueError(empty_train_split(workload.name, workload.params))
        held_out = wl.tasks("eval")
        # eval.num_prompts bounds the held-out split; a second set (``eval_set``) comes whole
        evals = ([p for p in held_out if "eval_set" not in p][: workload.eval.num_prompts]
                 + [p for p in held_out if "eval_set" in p])
        self._started = time.time()
        #: one random stream for prompt orders and replay sampling (saved with the run)
        rng = random.Random(seed)
        self.mixer = Mixer(workload.name, wl.source_weights(), self._train, self.policy_names,
                           workload.group_size, rng)
        self.curator = R.make(R.CURATORS, dataflow.curator.type, dataflow.curator.params, seed)
        self.group_filter = R.make(R.FILTERS, dataflow.group_filter.type, dataflow.group_filter.params, seed)
        self.ordering = R.make(R.ORDERINGS, dataflow.ordering.type, dataflow.ordering.params, seed)
        self._slots, self._slots_at = 0, 0.0
        self.leases = Leases(dataflow.lease_seconds, dataflow.max_attempts, self._task_failed)
        self.ledger = self.leases.ledger
        self.buffers = Buffers(self.policy_names, batch_size=dataflow.batch_size, group_size=workload.group_size,
                               limit=lambda: self.limit, max_staleness=dataflow.max_staleness, ledger=self.ledger,
                               rng=rng, consuming=lambda policy: self.paces[policy].active(),
                               replay=dataflow.replay_rows > 0)
        self.metrics = rec.MetricsLog(metrics_path)
        self.service = rec.ServiceTimes()
        #: the oldest weights among the leasing nodes, per policy (admission by version)
        self.oldest = admission.OldestVersions(self.policy_names)
        self.evals = EvalRounds(evals, [self.mixer.source_of(p) for p in evals], k=workload.eval.k,
                                policies=self.policy_names, workflow=workload.workflow,
                                by_source=len(self.mixer.weights) > 1, started=self._started,
                                write=self.metrics.write, final=max_steps)
        self.versions: dict[str, int] = {p: 0 for p in self.policy_names}
        #: when each trainer asked for batches (admission tells a slow trainer from a stopped one)
        self.paces = {p: admission.TrainerPace() for p in self.policy_names}
        #: per policy: times its trainer was lost and replaced (``trainer_restarted``)
        self.trainer_restarts: Counter = Counter()
        self.generated = rec.Generated.for_policies(self.policy_names)
        self.finished = False
        self._ready_event: asyncio.Event | None = None
        #: groups the data layer may still create; None = free running (the AstraFlow mode).
        #: The trainer-centred baseline (``run.mode: sync``) opens one iteration at a time.
        self.budget: int | None = 0 if gated else None
        self._state_path = Path(state_path) if state_path else None
        #: what was restored (None: nothing), and per policy the versions of batches the layer this
        #: one replaced had served (their trainer may never have received them: asked again, they
        #: are put back, not dropped)
        self.restored, self._in_doubt = self.durability.restore(self, keep_leases)
        # the curve starts where training starts: at 0 now; a resumed run's versions move forward
        # first (``trainer_restarted``), then ``resume_evaluation`` starts its round
        self._eval_at_start = bool(workload.eval.every) and not keep_leases
        if self._eval_at_start and not any(self.versions.values()):
            self._eval_at_start = False
            self._start_eval(0)

    # ------------------------------------------------------------------ wiring
    @property
    def groups_per_batch(self) -> int:
        return self.cfg.batch_size // self.wcfg.group_size

    @property
    def limit(self) -> int:
        """Groups allowed ahead of training (see ``mixing.py``, *rollout ahead of training*),
        raised to the leasing nodes' task slots with ``prefetch_covers_nodes``."""
        base = self.groups_per_batch + self.cfg.prefetch_groups
        if not self.cfg.prefetch_covers_nodes:
            return base
        return max(base, -(-self._node_slots() // self.wcfg.group_size))

    def _node_slots(self) -> int:
        """Task slots of the nodes seen within ``lease_seconds`` that do not drain (the slots
        their heartbeats report, else the capacity they last leased with); recounted at most
        once a second (a pass over every node)."""
        now = time.time()
        if now - self._slots_at > 1.0:
            self._slots_at = now
            self._slots = sum(int(i.get("slots", i.get("capacity", 0))) for i in self.leases.nodes.values()
                              if not i.get("draining") and not i.get("gone") and not i.get("stock")
                              and now - float(i.get("last_seen", 0.0)) <= self.cfg.lease_seconds)
        return self._slots

    @property
    def counts(self) -> dict[str, Counter]:
        """Per-policy dataflow counts (``Buffers.counts``)."""
        return self.buffers.counts

    def _rules(self) -> dict[str, Any]:
        return {"curator": self.curator, "group_filter": self.group_filter, "ordering": self.ordering}

    def _event(self) -> asyncio.Event:
        if self._ready_event is None:
            self._ready_event = asyncio.Event()
        return self._ready_event

    def _notify(self) -> None:
        """Wake every waiting ``lease`` and ``next_batch`` (they re-check their condition)."""
        self._event().set()
        self._ready_event = asyncio.Event()

    async def _wait(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._event().wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass

    def _refill(self) -> None:
        """Create train groups while the rollout-ahead bound and admission allow (``admission.refill``)."""
        admission.refill(self)

    def _task_failed(self, task: RolloutTask) -> None:
        """A task ended as failed (``Leases``): its round or group goes on without it."""
        if task.kind == "eval":
            self.evals.failed(task)
            return
        grp = self.buffers.rolling[task.group_id]
        grp.failed.add(task.task_id)
        if grp.done():
            self._ingest(grp)

    def _ingest(self, grp: RolloutGroup) -> None:
        first_rewards = self.buffers.ingest(grp, self.group_filter)
        if first_rewards:
            self.curator.observe(grp.prompt_key, first_rewards)
        self._notify()

    def _start_eval(self, version: int) -> None:
        for task in self.evals.start(version, taken=self.ledger.tasks.__contains__):
            self.leases.add(task)

    # ------------------------------------------------------------------ RaaS-facing
    async def lease(self, node: str, capacity: int, wait: float = 0.0,
                    versions: dict[str, int] | None = None) -> list[RolloutTask]:
        """Up to ``capacity`` tasks for ``node`` (evaluation tasks first). ``wait``: when there
        are none, wait up to this many seconds for some (a long poll: the node gets the tasks
        of a batch the moment the trainer's request makes room for them, with one call).
        ``versions``: the weight version the node holds per policy (admission by version);
        while admission refuses new groups because a node's weights are too old, the call
        returns at once, so that the node asks again with the weights it loads next."""
        return (await self._lease([(node, capacity, versions)], wait))[node]

    async def lease_many(self, requests: list[tuple[str, int, dict[str, int] | None]],
                         wait: float = 0.0) -> dict[str, list[RolloutTask]]:
        """``lease`` for several nodes in one call (the nodes of one rollout worker): each
        ``(node, capacity, versions)`` gets what its own ``lease`` would, in the order given;
        the long poll ends when any of them can be served."""
        return await self._lease(requests, wait)

    async def _lease(self, requests: list, wait: float) -> dict[str, list[RolloutTask]]:
        t0 = time.perf_counter()
        try:
            return await self._lease_now(requests, wait)
        finally:
            self.service.add("lease", time.perf_counter() - t0)

    async def _lease_now(self, requests: list, wait: float) -> dict[str, list[RolloutTask]]:
        mark = self._mark()
        self.leases.expire()
        now = time.time()
        out: dict[str, list[RolloutTask]] = PackedDict()
        asking = []
        for node, capacity, versions in requests:
            out[node] = Packed()
            info = self.leases.node(node)
            info["last_seen"] = now
            info["capacity"] = capacity
            if versions is not None:
                info["versions"] = dict(versions)
                self.oldest.saw(versions)
            if not info["draining"] and capacity > 0:
                asking.append((node, capacity, info))
        if not asking:
            await self._durable(mark)
            return out
        self._refill()
        deadline = now + wait
        while (not self.leases.waiting() and not self.finished
               and not all(info["draining"] for _, _, info in asking)):
            remaining = deadline - time.time()
            if remaining <= 0:
                break
            # (a lease stock has no weights of its own to load: it waits)
            if self.mixer.refused and any(admission.lags(info.get("versions"), self.versions)
                                          for _, _, info in asking if not info.get("stock")):
                break
            # woken by _notify (a batch served, trajectories ingested, a version published)
            await self._wait(min(remaining, 0.1))
            self.leases.expire()
            self._refill()
        for node, capacity, _ in asking:  # a node named twice gets both shares (none is orphaned)
            out[node].extend(self.leases.take(node, capacity))
        await self._durable(mark)  # a node never runs a task the next data layer does not know
        return out

    async def lease_ahead(self, worker: str, capacity: int, wait: float = 0.0) -> list[RolloutTask]:
        """``lease`` for the lease stock of ``worker`` (``lease_stock_name``): tasks its nodes
        take without a call here, each moving to its node when that node's heartbeat names it
        among those it holds, or completes it. The stock drains and goes with its worker. Its
        heartbeat, not this call, reports the weight versions its nodes hold."""
        name = lease_stock_name(worker)
        self.leases.node(name).update(stock=True, worker=worker)
        return (await self._lease([(name, capacity, None)], wait))[name]

    async def return_leases(self, worker: str, task_ids: list[str]) -> int:
        """Tasks the lease stock of ``worker`` leased and never handed out go back to the front
        of their queue, no attempt counted. Returns how many it still held."""
        n, holder = 0, lease_stock_name(worker)
        for tid in reversed(task_ids):  # each goes to the front: their order is kept
            if self.leases.held.get(tid, (None,))[0] == holder:
                self.leases.unlease(tid)
                n += 1
        if n:
            self._notify()
            await self._durable()
        return n

    async def complete(self, refs: list[TrajectoryRef]) -> int:
        """Record committed trajectories; returns how many were new (others were duplicates).
        A long list is taken in slices, other calls (a lease, a heartbeat) answered between."""
        t0 = time.perf_counter()
        mark = self._mark()
        new = 0
        for i, ref in enumerate(refs):
            if i and not i % COMPLETE_SLICE:
                await asyncio.sleep(0)
            task = self.leases.complete(ref)
            if task is None:
                continue
            new += 1
            self.generated.add(ref)
            if ref.kind == "eval":
                self.ledger.end(task.task_id, "evaluated")
                self.evals.record(task, ref)
            else:
                grp = self.buffers.rolling[task.group_id]
                grp.results[ref.task_id] = ref
                if grp.done():
                    self._ingest(grp)
        await self._durable(mark)
        self.service.add("complete", time.perf_counter() - t0)
        return new

    async def fail(self, task_id: str, reason: str, attempt: int | None = None) -> None:
        """A node could not run a task; it is requeued (or fails after ``max_attempts``).
        ``attempt``: the attempt the node ran (``RolloutTask.attempt``); a report of an earlier
        one (its lease expired and the task went to another node) changes nothing."""
        task = self.leases.tasks.get(task_id)
        if attempt is not None and task is not None and task.attempt != attempt:
            return
        if task_id in self.leases.held:
            self.leases.give_back(task_id, f"failed:{reason}")
            await self._durable()

    async def heartbeat(self, node: str, stats: dict[str, Any]) -> dict[str, Any]:
        """Renew the node's leases and record its stats; tells the node whether to drain.
        ``stats["holding"]``: the ids of the tasks the node still works on (only their leases
        are renewed; absent: all of the node's)."""
        return PackedDict((await self.heartbeat_many({node: stats}))[node])

    async def heartbeat_many(self, beats: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """``heartbeat`` for several nodes in one call: node -> its stats; node -> its answer."""
        t0 = time.perf_counter()
        mark = self._mark()
        now = time.time()
        infos = {}
        newer = False
        for node, stats in beats.items():
            holding = stats.pop("holding", None)
            info = infos[node] = self.leases.node(node)
            # a lease stock's parked refills re-check admission when its nodes' weights move on
            # (nodes' own leases would have, each time they asked)
            newer = newer or bool(stats.get("stock") and stats.get("versions") != info.get("versions"))
            info.update(stats)
            if not stats.get("stocked"):  # a stocked node's versions reach here through its stock
                self.oldest.saw(stats.get("versions"))
            info["last_seen"] = now
            self.leases.renew(node, None if holding is None else set(holding))
        self.leases.expire()
        if newer:
            self._notify()
        await self._durable(mark)
        self.service.add("heartbeat", time.perf_counter() - t0)
        return PackedDict((node, self._beat_reply(info)) for node, info in infos.items())

    def _beat_reply(self, info: dict[str, Any]) -> dict[str, Any]:
        reply = {"draining": info["draining"], "finished": self.finished}
        if info.get("stock"):  # what a stock needs to answer its waiting nodes as ``lease`` would
            reply.update(versions=dict(self.versions), refused=bool(self.mixer.refused))
        return reply

    async def drain(self, node: str) -> None:
        """Stop leasing to ``node`` and the nodes sharing its worker (they finish what they hold)."""
        for name in self.leases.on_worker(node):
            self.leases.node(name)["draining"] = True
            self.leases.touch_node(name)
        await self._durable()

    async def node_gone(self, node: str) -> int:
        """The node's worker is gone: its leases return to the queue now. Returns how many."""
        n = self.leases.node_gone(node)
        await self._durable()
        return n

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs (``record.snapshot``)."""
        return rec.snapshot(versions=self.versions, cfg=self.cfg, rules=self._rules(), mixer=self.mixer,
                            group_seq=self.buffers.group_seq)

    def _mark(self) -> int:
        """A number that changes whenever a task is created, leased, requeued, completed or ends."""
        return self.ledger.events.total()

    async def _durable(self, mark: int | None = None, sync: bool = False) -> None:
        """Return once the state's changes are in the change log (``durable.Durability.commit``);
        with ``mark`` (``_mark()`` at the call's start), only when the ledger moved since."""
        if mark is None or self._mark() != mark:
            await self.durability.commit(sync)

    # ------------------------------------------------------------------ evaluation
    async def start_eval(self, version: int) -> None:
        """Queue a held-out evaluation of the first policy at ``version`` (idempotent)."""
        self._start_eval(version)
        await self._durable()

    async def eval_done(self, version: int) -> bool:
        return self.evals.done(version)

    # ------------------------------------------------------------------ orchestrator-facing
    async def finish(self) -> dict[str, Any]:
        """End the run: every task that has not ended is dropped with reason ``run_ended``.
        Afterwards every task in the ledger has ended exactly once."""
        self.finished = True
        self.evals.write(past_unfinished=True)  # rounds held back behind an unfinished one were measured
        self.buffers.end_run()
        # a completed task still routed to a buffer is ended by it, not here
        self.leases.end_all(keep=self.buffers.routed_left)
        self.buffers.rolling.clear()  # every task of a group still in rollout has ended: a resume starts afresh
        self.evals.drop_unfinishable()  # their tasks just ended: a resume must not wait for them
        self.metrics.flush()
        await self._durable(sync=True)
        return self.ledger.summary()

    async def progress(self) -> dict[str, int]:
        """Cheap counters for pollers that only need to know how far the run is."""
        return PackedDict(sequences_generated=self.generated.sequences, tokens_generated=self.generated.tokens,
                          **{f"version_{p}": v for p, v in self.versions.items()})

    async def state(self) -> dict[str, Any]:
        """A JSON-able snapshot for ``astraflow status``, the dashboard and tests."""
        return rec.layer_status(self)

    def lane_enabled(self) -> bool:
        return self.cfg.direct_lane

    async def close(self) -> None:
        await self.close_lane()
        await self.durability.close()  # first: its last record reads the metrics file's length
        self.metrics.close()
