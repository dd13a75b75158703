"""The data layer: the Dask actor that RaaS nodes and trainers meet through.

It never runs a model. RaaS nodes pull tasks with ``lease`` and report stored trajectories with
``complete``; trainers pull batches with ``next_batch`` and report new weight versions with
``published``. This module is the front: its class takes the calls of ``nodes_facing.py`` and
``serving.py`` as mixins, keeps the orchestrator-facing ones, and wires the rooms that own the
state, each with its named asynchronous overlap:

* ``leases.py``: task queues, leases and the ledger hand-off (*lease expiry*);
* ``ledger.py``: every leased task's record, which ends exactly once;
* ``admission.py``: a new group is rolled out only if it can still be trained on
  (*admission vs staleness*);
* ``mixing.py``: per-source prompt orders, rollout-ahead shares and batch quotas (*rollout
  ahead of training*);
* ``buffers.py``: ingest of finished groups, per-policy buffers, replay and the batch itself,
  served by reference (*staleness*);
* ``nodes_facing.py``: the RaaS-node-facing calls (leases, completions, failures, heartbeats,
  drains);
* ``serving.py``: the trainer-facing calls (batches served, versions committed, a trainer
  replaced: *served, then committed*);
* ``evals.py``: held-out evaluation rounds;
* ``record.py``: the metrics lines and the saved state;
* ``rules.py``: the dataflow rules (curator, group filter, ordering) run at their stages, and
  ``rule_checks.py`` what a user's rule may return;
* ``retention.py``: trajectory segments deleted once nothing can need their rows (opt-in);
* ``durable.py``: what every call that changed the state writes before it answers, and the
  restore (a re-placed or resumed data layer continues from it): ``changelog.py`` writes the
  change log of the entries ``changes.py`` defines, beside the ledger's journal.

Every actor call is ``async``: Dask runs async actor methods on the worker's event loop,
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

from astraflow.contracts import RolloutTask
from astraflow.lane import LaneServed
from astraflow.dataflow import admission, durable
from astraflow.dataflow import record as rec
from astraflow.dataflow import rules as R
from astraflow.dataflow.buffers import Buffers, RolloutGroup
from astraflow.dataflow.config import DataflowConfig
from astraflow.dataflow.evals import EvalRounds
from astraflow.dataflow.leases import Leases
from astraflow.dataflow.mixing import Mixer, empty_train_split, prompt_index
from astraflow.dataflow.nodes_facing import NodeFacing
from astraflow.dataflow.retention import SegmentRetention
from astraflow.dataflow.serving import BatchTimeout, TrainerFacing
from astraflow.transport import PackedDict
from astraflow.workloads.base import make_workload
from astraflow.workloads.config import WorkloadConfig
from astraflow.workloads.split import evaluated
from storage.trajectories import open_trajectory_store

__all__ = ["BatchTimeout", "DataLayer"]


#: allocations between young-generation collections in the data layer's process (the default
#: is 700), and how many young collections come before a middle one (default 10)
GC_THRESHOLDS = (50_000, 20)


def collect_less_often() -> None:
    """The data layer keeps a large heap that lives long (tasks, leases, buffers, the change
    log's shadow) and allocates fast on every call; with Python's default thresholds a full
    collection rescans that heap several times a second, which costs a large share of the
    layer's CPU and pauses every call behind it. Collecting after more allocations makes full
    collections rare; garbage that refcounting frees (nearly all of it) is unaffected, cycles
    wait longer. Never lowers thresholds set higher by the process."""
    g0, g1, g2 = gc.get_threshold()
    gc.set_threshold(max(g0, GC_THRESHOLDS[0]), max(g1, GC_THRESHOLDS[1]), g2)


class DataLayer(NodeFacing, TrainerFacing, LaneServed):
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
        keep_trajectories: bool = True,
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
        #: ``keep_trajectories`` False: segments no one needs any more are deleted (``retention``)
        self.retention = SegmentRetention(self.store, enabled=not keep_trajectories)
        wl = make_workload(workload.name, workload.params, workload.seed)
        self._train = wl.tasks("train")
        if not self._train and max_steps > 0:
            raise ValueError(empty_train_split(workload.name, workload.params))
        held_out = wl.tasks("eval")
        evals = evaluated(held_out, workload.eval.num_prompts)
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
        #: a dataflow rule's first failure in a node's call (``RuleError``): the orchestrator ends
        #: the run with it instead of replacing the node that happened to call
        self.rule_error: str | None = None
        self._ready_event: asyncio.Event | None = None
        #: groups the data layer may still create; None = free running (the AstraFlow mode).
        #: The trainer-centred baseline (``run.mode: sync``) opens one iteration at a time.
        self.budget: int | None = 0 if gated else None
        #: gated with several sources: groups the data layer may still create, per source (the
        #: sources the iteration's batch lacks, ``admission.iteration_sources``)
        self.budget_sources: Counter | None = Counter() if gated and self.mixer.mixing else None
        self._state_path = Path(state_path) if state_path else None
        #: what was restored (None: nothing), and per policy the versions of batches the layer this
        #: one replaced had served (their trainer may never have received them: asked again, they
        #: are put back, not dropped)
        self.restored, self._in_doubt = self.durability.restore(self, keep_leases)
        if not keep_leases:  # a new incarnation: the nodes that wrote the (run's own) store's segments are gone
            self.retention.segments_done(self.store.segments())
        #: failed tasks counted in the last step line (a restored ledger's are not new)
        self._failed_recorded = self.ledger.events["failed"]
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
        accepted = self._accepted()
        rewards, success = self.buffers.ingest(grp, self.group_filter)
        if self._accepted() > accepted:  # a group with a signal, kept for a batch (``NothingCompletes``)
            self.ledger.events["kept"] += 1
        if rewards:
            self.curator.observe(grp.prompt_key, success if getattr(self.curator, "observes", "") == "success"
                                 else rewards)
        self._notify()

    def _accepted(self) -> int:
        return sum(c["accepted"] for c in self.buffers.counts.values())

    def _start_eval(self, version: int) -> None:
        for task in self.evals.start(version, taken=self.ledger.tasks.__contains__):
            self.leases.add(task)

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
    async def finish(self, completed: bool = True) -> dict[str, Any]:
        """End the run: every task that has not ended is dropped with reason ``run_ended``.
        Afterwards every task in the ledger has ended exactly once, except, when the run stopped
        before its end (``completed`` False: a lost trainer, a failure, a signal) and its state is
        durable, the tasks of batches served and never committed: they stay served for the resume
        to put back (``Buffers.end_run``), counted in the summary's ``kept_for_resume``."""
        self.finished = True
        self.evals.write(past_unfinished=True)  # rounds held back behind an unfinished one were measured
        keep = not completed and self.durability.snapshot_path is not None  # else no resume could put them back
        if keep:  # the resume rolls out the prompts of the groups cut short first
            self._put_back_rolling()
        self.buffers.end_run(keep_served=keep)
        # a completed task still routed to a buffer is ended by it, not here
        self.leases.end_all(keep=self.buffers.routed_left)
        self.buffers.rolling.clear()  # every task of a group still in rollout has ended: a resume starts afresh
        self.evals.drop_unfinishable()  # their tasks just ended: a resume must not wait for them
        self.metrics.flush()
        await self._durable(sync=True)
        summary = self.ledger.summary()
        if keep:
            summary["kept_for_resume"] = len(self.buffers.routed_left)  # the tasks of the batches kept
        return summary

    def _put_back_rolling(self) -> None:
        """The prompts of the train groups still in rollout, back at the head of their sources'
        orders (their tasks end as ``run_ended``; without this the resume would go on after them)."""
        by_source: dict[str, list[int]] = {}
        for grp in self.buffers.rolling.values():
            if grp.kind == "train" and (index := prompt_index(grp.prompt_key)) is not None:
                by_source.setdefault(grp.source, []).append(index)
        for source, indices in by_source.items():
            if source in self.mixer.order:
                self.mixer.put_back(source, indices)

    async def progress(self) -> dict[str, int]:
        """Cheap counters for pollers that only need to know how far the run is."""
        return PackedDict(sequences_generated=self.generated.sequences, tokens_generated=self.generated.tokens,
                          **{f"version_{p}": v for p, v in self.versions.items()})

    async def state(self, evals: int | None = None) -> dict[str, Any]:
        """A JSON-able snapshot for ``astraflow status``, the dashboard and tests; with ``evals``,
        only the last that many evaluation records (a tick's: the whole history, which grows
        with every round, is read once, at the run's end)."""
        return rec.layer_status(self, evals)

    def lane_enabled(self) -> bool:
        return self.cfg.direct_lane

    async def close(self) -> None:
        await self.close_lane()
        await self.retention.wait()  # its deletions come after a change-log write: not cut off by the close
        await self.durability.close()  # first: its last record reads the metrics file's length
        self.metrics.close()
