"""The data layer: tasks, leases, the trajectory index, per-policy buffers, batches.

It runs as one Dask actor and never runs a model. RaaS nodes pull tasks with ``lease`` and
report stored trajectories with ``complete``; trainers pull batches with ``next_batch`` and
report new weight versions with ``published``. Dataflow policies (``policies.py``) decide
which prompts are rolled out, which groups are kept and in which order buffered groups are
consumed; the data layer only runs them at their stages.

Every public method is ``async``: Dask runs async actor methods on the worker's event loop,
one at a time between awaits, so the state below needs no locks, and a trainer blocked in
``next_batch`` does not block the leases that will fill its batch.

Named asynchronous overlaps and their invariants:

* *lease expiry*: a task leased by a node that neither completes it nor renews it (heartbeat)
  within ``lease_seconds`` returns to the queue with ``attempt + 1``; a late completion of an
  earlier attempt is still accepted if the task has not ended (first completion wins), later
  ones are counted as duplicates. Every task ends exactly once (``Ledger``).
* *rollout ahead of training*: groups in rollout plus the groups buffered for the hungriest
  policy stay below ``groups_per_batch + prefetch_groups``, which bounds staleness and wasted
  rollouts without coupling independent policies.
* *staleness*: a sequence whose oldest token version for the consuming policy is more than
  ``max_staleness`` versions behind the trainer's version is dropped and counted as ``stale``.

Mixing of sources (datasets/workloads by weight, the ``mix`` workload): every group carries
the source of its prompt (``payload["source"]``; a single-source workload's ``source_weights()`` is
one source ``""`` of weight 1, and everything below reduces to the single-source rules).

* *before rollout*: each source has its own shuffled prompt order and its own rollout-ahead
  bound (its weighted share of ``groups_per_batch + prefetch_groups``, raised to what a
  waiting batch still lacks of it); the next group goes to the source furthest below its
  weighted share of the groups ahead, so a source whose groups are filtered more often gets
  more rollouts, and a source with a full buffer never blocks a starved one.
* *at batch time*: a batch's groups are apportioned to sources by weight (largest credit
  first, the fractional credit carried across batches, so long-run proportions are exact);
  within a source the configured ordering picks groups. A batch waits until every source
  has its quota; the credit is saved with the rest of the state.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from astraflow.dataflow.config import DataflowConfig

from astraflow.workloads.config import WorkloadConfig
from astraflow.contracts import BatchItem, Batch, RolloutTask, SequenceSummary, TrajectoryRef, sequence_from_stored
from astraflow.transport import Packed
from astraflow.dataflow import policies as P
from astraflow.dataflow.ledger import TERMINAL, Ledger
from astraflow.workloads.base import make_workload
from astraflow.workloads.mix import SOURCE_KEY
from storage.trajectories import open_trajectory_store

log = logging.getLogger("astraflow.dataflow")


class BatchTimeout(TimeoutError):
    """``next_batch`` found no full batch before its deadline."""


@dataclass
class _Group:
    group_id: str
    prompt_key: str
    kind: str
    task_ids: list[str]
    source: str = ""
    results: dict[str, TrajectoryRef] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)

    def done(self) -> bool:
        return len(self.results) + len(self.failed) == len(self.task_ids)


@dataclass
class _Item:
    """A sequence routed to one policy's buffer, waiting to be consumed."""

    task_id: str
    summary: SequenceSummary
    oldest_version: int
    group_mean: float
    group_std: float
    group_size: int


@dataclass
class _Ready:
    group_id: str
    ingest_seq: int
    items: list[_Item]
    source: str = ""

    @property
    def oldest_version(self) -> int:
        return min(i.oldest_version for i in self.items)


@dataclass
class _EvalRound:
    version: int
    policy: str
    k: int
    rewards: dict[str, list[float]] = field(default_factory=dict)  # prompt -> rewards
    remaining: int = 0
    started: float = field(default_factory=time.time)
    #: weight versions of the first policy that actually generated the evaluated answers
    versions_used: list[int] = field(default_factory=list)
    #: eval group id -> source of its prompt (mixtures only)
    sources: dict[str, str] = field(default_factory=dict)
    #: the finished record; written once every earlier round of the policy is written too
    result: dict[str, Any] | None = None
    written: bool = False


class DataLayer:
    """Dask actor: owns tasks, leases, the trajectory index and the per-policy buffers."""

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
    ):
        self.cfg = dataflow
        self.wcfg = workload
        self.policy_names = list(policies)
        self.max_steps = max_steps
        self.store = open_trajectory_store(store_url, "a")
        #: the store object is not thread-safe and batches of different policies are read in
        #: worker threads concurrently (two trainers asking at once): reads take this lock.
        self._store_lock = threading.Lock()
        self._workload = make_workload(workload.name, workload.params, workload.seed)
        self._train = self._workload.tasks("train")
        self._eval = self._workload.tasks("eval")[: workload.eval.num_prompts]
        #: source name -> weight; one source "" of weight 1 unless the workload is a mixture
        self.source_weights: dict[str, float] = dict(self._workload.source_weights())
        self._mixing = set(self.source_weights) != {""}
        #: source -> indices into ``self._train`` of its prompts
        self._by_source: dict[str, list[int]] = {s: [] for s in self.source_weights}
        for i, payload in enumerate(self._train):
            src = self._source_of(payload)
            if src not in self._by_source:
                raise ValueError(f"workload {workload.name!r}: a payload names source {src!r}, "
                                 f"not one of its source_weights() {sorted(self.source_weights)}")
            self._by_source[src].append(i)
        empty = [s for s, idx in self._by_source.items() if not idx]
        if empty and self._train:
            raise ValueError(f"workload {workload.name!r}: sources {empty} have no training prompts; "
                             "give them data or remove them")
        self._rng = random.Random(seed)
        #: per source: the rest of the current epoch's shuffled prompt order, and epochs started
        self._order: dict[str, list[int]] = {s: [] for s in self.source_weights}
        self._epoch: dict[str, int] = {s: 0 for s in self.source_weights}
        #: batch-time mixing credit, per policy and source, in groups (sums to 0 per policy)
        self.mix_credit: dict[str, dict[str, float]] = {
            p: {s: 0.0 for s in self.source_weights} for p in policies}
        #: policy -> source -> sequences a waiting ``next_batch`` still lacks (see ``_refill``)
        self._short: dict[str, dict[str, int]] = {}
        self.consumed_by_source: dict[str, Counter] = {p: Counter() for p in policies}
        self.groups_by_source: Counter = Counter()
        self.curator = P.make(P.CURATORS, dataflow.curator.type, dataflow.curator.params, seed)
        self.group_filter = P.make(P.FILTERS, dataflow.group_filter.type, dataflow.group_filter.params, seed)
        self.ordering = P.make(P.ORDERINGS, dataflow.ordering.type, dataflow.ordering.params, seed)

        self.ledger = Ledger()
        self.tasks: dict[str, RolloutTask] = {}
        self.pending: deque[str] = deque()
        self.eval_pending: deque[str] = deque()
        self.leases: dict[str, tuple[str, float]] = {}  # task -> (node, deadline)
        self.groups: dict[str, _Group] = {}
        self.task_group: dict[str, str] = {}
        self.routed_left: dict[str, int] = {}  # train task -> items not yet settled
        self.task_consumed: set[str] = set()
        #: per policy: the items of the batch served to a trainer at version v, by v, until the
        #: trainer reports v + 1 committed (``published``): only then are they consumed
        self.serving: dict[str, dict[int, list[_Item]]] = {p: {} for p in self.policy_names}
        self.task_drop_reason: dict[str, str] = {}
        self.buffers: dict[str, list[_Ready]] = {p: [] for p in self.policy_names}
        self.replay: dict[str, deque[BatchItem]] = {p: deque(maxlen=4 * dataflow.batch_size) for p in self.policy_names}
        self.versions: dict[str, int] = {p: 0 for p in self.policy_names}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.eval_rounds: dict[int, _EvalRound] = {}
        self.eval_results: list[dict[str, Any]] = []
        self.counts: dict[str, Counter] = {p: Counter() for p in self.policy_names}
        self.staleness_hist: dict[str, Counter] = {p: Counter() for p in self.policy_names}
        self.wait_s: dict[str, float] = {p: 0.0 for p in self.policy_names}
        self.last_batch: dict[str, dict[str, Any]] = {p: {} for p in self.policy_names}
        self.sequences_generated = 0
        #: sequences of training rollouts only (evaluation excluded): the cost of the data
        self.train_sequences_generated = 0
        self.tokens_generated = 0
        self.finished = False
        self._ingest_seq = 0
        self._group_seq = 0
        self._outstanding: set[str] = set()  # train groups being rolled out (not yet ingested)
        self._started = time.time()
        self._metrics = open(metrics_path, "a", buffering=1) if metrics_path else None
        self._ready_event: asyncio.Event | None = None
        #: groups the data layer may still create; None = free running (the AstraFlow mode).
        #: The trainer-centred baseline (``run.mode: sync``) opens one iteration at a time.
        self.budget: int | None = 0 if gated else None
        self._state_path = Path(state_path) if state_path else None
        if self._state_path is not None and self._state_path.exists():
            self._restore(json.loads(self._state_path.read_text()))
        if workload.eval.every:  # the curve starts where training starts (0, or a resumed version)
            self._start_eval(min(self.versions.values()))

    # ------------------------------------------------------------------ helpers
    @property
    def groups_per_batch(self) -> int:
        return self.cfg.batch_size // self.wcfg.group_size

    def _event(self) -> asyncio.Event:
        if self._ready_event is None:
            self._ready_event = asyncio.Event()
        return self._ready_event

    def _notify(self) -> None:
        ev = self._event()
        ev.set()
        self._ready_event = asyncio.Event()

    def _read_rows(self, refs: list) -> list:
        with self._store_lock:
            return self.store.read(refs)

    def _write_metrics(self, record: dict[str, Any]) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps(record, default=float) + "\n")

    def _source_of(self, payload: dict[str, Any]) -> str:
        return str(payload.get(SOURCE_KEY, "")) if self._mixing else ""

    def _next_prompt(self, source: str = "") -> int:
        order = self._order[source]
        if not order:
            order.extend(self._by_source[source])
            self._rng.shuffle(order)
            self._epoch[source] += 1
        return order.pop()

    def _refill(self) -> None:
        """Create train groups while the rollout-ahead bound allows (per source, see
        ``_refill_source``)."""
        limit = self.groups_per_batch + self.cfg.prefetch_groups
        proposals = 0
        while not self.finished and proposals < max(len(self._train), 1):
            source = self._refill_source(limit)
            if source is None:
                return
            if self.budget is not None and self.budget <= 0:
                return
            proposals += 1
            idx = self._next_prompt(source)
            payload = self._train[idx]
            key = f"p{idx}"
            if not self.curator.accept(key, payload):
                self.counts[self.policy_names[0]]["curator_skipped"] += 1
                continue
            self._group_seq += 1
            if self.budget is not None:
                self.budget -= 1
            gid = f"g{self._group_seq:07d}"
            tids = [f"{gid}/{j}" for j in range(self.wcfg.group_size)]
            self.groups[gid] = _Group(gid, key, "train", tids, source)
            self.groups_by_source[source] += 1
            self._outstanding.add(gid)
            for tid in tids:
                self._add_task(
                    RolloutTask(
                        task_id=tid, group_id=gid, policies=tuple(self.policy_names),
                        workflow=self.wcfg.workflow, prompt=payload, kind="train",
                    )
                )
                self.pending.append(tid)

    def _ahead(self, rolling: Counter) -> dict[str, int]:
        """Groups rolled out ahead of training, per source: those in rollout (``rolling``)
        plus what the hungriest policy has buffered. Using the hungriest policy keeps policies
        independent: a stalled trainer's growing buffer does not starve the others (it is
        capped instead, see ``_cap_buffer``)."""
        return {s: rolling[s] + min(sum(1 for g in b if g.source == s) for b in self.buffers.values())
                for s in self.source_weights}

    def _refill_source(self, limit: int) -> str | None:
        """The source of the next group, or ``None`` when every source is at its bound.

        A source's bound is its weighted share of ``limit`` (rounded up; all of it for a
        single source). A source may exceed it while a waiting batch lacks more of its
        sequences than its groups in rollout will bring (otherwise a buffer holding partial
        groups could wait forever). Among the sources below their bound, the one whose
        groups ahead, plus the new one, are the smallest multiple of its weight goes next:
        groups ahead follow the weights, so a source whose groups are filtered (and leave
        the count) is refilled more often."""
        rolling = Counter(self.groups[g].source for g in self._outstanding)
        ahead = self._ahead(rolling)
        total_w = sum(self.source_weights.values())
        gs = self.wcfg.group_size
        best, best_key = None, math.inf
        for s, w in self.source_weights.items():
            bound = limit if len(self.source_weights) == 1 else max(1, math.ceil(limit * w / total_w - 1e-9))
            in_rollout = gs * rolling[s]
            starved = any(short.get(s, 0) > in_rollout for short in self._short.values())
            if ahead[s] >= bound and not starved:
                continue
            key = (ahead[s] + 1) / w
            if key < best_key:
                best, best_key = s, key
        return best

    def _cap_buffer(self, policy: str) -> None:
        """A policy whose trainer does not consume keeps at most ``4 x`` a batch of groups;
        the oldest beyond that are dropped as ``overflow``."""
        buf = self.buffers[policy]
        cap = 4 * (self.groups_per_batch + self.cfg.prefetch_groups)
        while len(buf) > cap:
            grp = buf.pop(0)
            self.counts[policy]["overflow_dropped"] += len(grp.items)
            self._settle(policy, grp.items, "overflow")

    def _add_task(self, task: RolloutTask) -> None:
        self.tasks[task.task_id] = task
        self.task_group[task.task_id] = task.group_id
        self.ledger.add(task.task_id)

    def _expire(self) -> None:
        now = time.time()
        for tid, (node, deadline) in list(self.leases.items()):
            if deadline < now:
                self._return(tid, "lease_expired")

    def _return(self, tid: str, why: str) -> None:
        """A leased task comes back (expired, failed, node gone): requeue or fail it."""
        del self.leases[tid]
        task = self.tasks[tid]
        if task.attempt + 1 >= self.cfg.max_attempts:
            self.ledger.requeue(tid, why)
            self._fail(tid, f"{why}_after_{self.cfg.max_attempts}_attempts")
            return
        self.ledger.requeue(tid, why)
        self.tasks[tid] = replace(task, attempt=task.attempt + 1, lease_deadline=None)
        (self.eval_pending if task.kind == "eval" else self.pending).appendleft(tid)

    def _fail(self, tid: str, reason: str) -> None:
        self.ledger.end(tid, "failed", reason)
        task = self.tasks.pop(tid)
        if task.kind == "eval":
            rnd = self.eval_rounds.get(int(task.min_version))
            if rnd is not None:
                rnd.remaining -= 1
                self._maybe_finish_eval(int(task.min_version))
            return
        grp = self.groups[task.group_id]
        grp.failed.add(tid)
        if grp.done():
            self._ingest_group(grp)

    # ------------------------------------------------------------------ RaaS-facing
    async def lease(self, node: str, capacity: int, wait: float = 0.0) -> list[RolloutTask]:
        """Up to ``capacity`` tasks for ``node`` (evaluation tasks first). ``wait``: when there
        are none, wait up to this many seconds for some (a long poll: the node gets the tasks
        of a batch the moment the trainer's request makes room for them, with one call)."""
        self._expire()
        info = self.nodes.setdefault(node, {"leased": 0, "completed": 0, "draining": False})
        info["last_seen"] = time.time()
        if info["draining"] or capacity <= 0:
            return []
        self._refill()
        deadline = time.time() + wait
        while not (self.eval_pending or self.pending) and not self.finished and not info["draining"]:
            remaining = deadline - time.time()
            if remaining <= 0:
                break
            try:  # woken by _notify (a batch served, trajectories ingested, a version published)
                await asyncio.wait_for(self._event().wait(), timeout=min(remaining, 0.1))
            except asyncio.TimeoutError:
                pass
            self._expire()
            self._refill()
        out: list[RolloutTask] = []
        deadline = time.time() + self.cfg.lease_seconds
        for queue in (self.eval_pending, self.pending):
            while queue and len(out) < capacity:
                tid = queue.popleft()
                task = replace(self.tasks[tid], lease_deadline=deadline)
                self.tasks[tid] = task
                self.ledger.lease(tid, node)
                self.leases[tid] = (node, deadline)
                out.append(task)
        info["leased"] += len(out)
        return Packed(out)

    async def complete(self, refs: list[TrajectoryRef]) -> int:
        """Record committed trajectories; returns how many were new (others were duplicates)."""
        new = 0
        for ref in refs:
            lease = self.leases.get(ref.task_id)
            if not self.ledger.tasks.get(ref.task_id) or not self.ledger.complete(ref.task_id):
                continue
            new += 1
            if lease is not None:
                del self.leases[ref.task_id]
            else:  # a late completion of an expired attempt that was requeued but not re-leased
                q = self.eval_pending if ref.kind == "eval" else self.pending
                if ref.task_id in q:
                    q.remove(ref.task_id)
            node = self.nodes.setdefault(ref.node, {"leased": 0, "completed": 0, "draining": False})
            node["completed"] += 1
            self.sequences_generated += len(ref.sequences)
            if ref.kind != "eval":
                self.train_sequences_generated += len(ref.sequences)
            self.tokens_generated += sum(s.num_tokens for s in ref.sequences)
            task = self.tasks.pop(ref.task_id)
            if ref.kind == "eval":
                self._record_eval(task, ref)
            else:
                grp = self.groups[task.group_id]
                grp.results[ref.task_id] = ref
                if grp.done():
                    self._ingest_group(grp)
        return new

    async def fail(self, task_id: str, reason: str) -> None:
        """A node could not run a task; it is requeued (or fails after ``max_attempts``)."""
        if task_id in self.leases:
            self._return(task_id, f"failed:{reason}")

    async def heartbeat(self, node: str, stats: dict[str, Any]) -> dict[str, Any]:
        """Renew the node's leases and record its stats; tells the node whether to drain."""
        info = self.nodes.setdefault(node, {"leased": 0, "completed": 0, "draining": False})
        info.update(stats)
        info["last_seen"] = time.time()
        deadline = time.time() + self.cfg.lease_seconds
        for tid, (n, _) in list(self.leases.items()):
            if n == node:
                self.leases[tid] = (n, deadline)
        self._expire()
        return {"draining": info["draining"], "finished": self.finished}

    async def drain(self, node: str) -> None:
        """Stop leasing to ``node`` (it finishes what it holds)."""
        self.nodes.setdefault(node, {"leased": 0, "completed": 0})["draining"] = True

    async def node_gone(self, node: str) -> int:
        """The node's worker is gone: its leases return to the queue now. Returns how many."""
        tids = [t for t, (n, _) in self.leases.items() if n == node]
        for tid in tids:
            self._return(tid, "node_gone")
        self.nodes.setdefault(node, {})["gone"] = True
        return len(tids)

    # ------------------------------------------------------------------ ingest
    def _ingest_group(self, grp: _Group) -> None:
        self._outstanding.discard(grp.group_id)
        self.groups.pop(grp.group_id, None)
        live = [t for t in grp.task_ids if t in grp.results]
        for tid in live:
            self.routed_left[tid] = 0
        first_rewards: list[float] = []
        for policy in self.policy_names:
            items: list[_Item] = []
            rewards: list[float] = []
            for tid in live:
                for s in grp.results[tid].sequences:
                    if policy in s.policy_tokens and s.policy_tokens[policy][0] > 0:
                        items.append(_Item(tid, s, s.policy_tokens[policy][1], 0.0, 0.0, 0))
                        rewards.append(s.reward)
            if not items:
                continue
            if policy == self.policy_names[0]:
                first_rewards = rewards
            c = self.counts[policy]
            c["sequences_ingested"] += len(items)
            for it in items:
                self.routed_left[it.task_id] += 1
            if len(items) < 2:
                self._settle(policy, items, "group_incomplete")
                continue
            keep, reason = self.group_filter.keep(rewards)
            if not keep:
                c["filtered"] += len(items)
                self._settle(policy, items, reason or "filtered")
                continue
            mean, std = float(np.mean(rewards)), float(np.std(rewards))
            for it in items:
                it.group_mean, it.group_std, it.group_size = mean, std, len(items)
            self._ingest_seq += 1
            self.buffers[policy].append(_Ready(grp.group_id, self._ingest_seq, items, grp.source))
            c["accepted"] += len(items)
            self._cap_buffer(policy)
        if first_rewards:
            self.curator.observe(grp.prompt_key, first_rewards)
        for tid in live:
            if self.routed_left.get(tid) == 0:
                self._end_train_task(tid, "no_policy_tokens")
        self._notify()

    def _settle(self, policy: str, items: list[_Item], drop_reason: str | None) -> None:
        """Items leave a buffer: consumed (``drop_reason`` None) or dropped."""
        for it in items:
            if drop_reason is None:
                self.task_consumed.add(it.task_id)
            else:
                self.task_drop_reason.setdefault(it.task_id, drop_reason)
            self.routed_left[it.task_id] -= 1
            if self.routed_left[it.task_id] == 0:
                self._end_train_task(it.task_id, self.task_drop_reason.get(it.task_id, "unknown"))

    def _end_train_task(self, tid: str, reason: str) -> None:
        self.routed_left.pop(tid, None)
        if tid in self.task_consumed:
            self.task_consumed.discard(tid)
            self.ledger.end(tid, "consumed")
        else:
            self.ledger.end(tid, "dropped", reason)
        self.task_drop_reason.pop(tid, None)

    # ------------------------------------------------------------------ trainer-facing
    def _available(self, policy: str, version: int) -> int:
        """Drop stale sequences from the buffer; count what is left."""
        buf = self.buffers[policy]
        total = 0
        for grp in list(buf):
            stale = [it for it in grp.items if version - it.oldest_version > self.cfg.max_staleness]
            if stale:
                self.counts[policy]["stale_dropped"] += len(stale)
                grp.items = [it for it in grp.items if it not in stale]
                self._settle(policy, stale, "stale")
            if not grp.items:
                buf.remove(grp)
            total += len(grp.items)
        return total

    def _available_by_source(self, policy: str, version: int) -> dict[str, int]:
        """``_available`` (stale sequences dropped), per source."""
        self._available(policy, version)
        out = {s: 0 for s in self.source_weights}
        for grp in self.buffers[policy]:
            out[grp.source] += len(grp.items)
        return out

    def _quotas(self, policy: str, need: int) -> tuple[dict[str, int], dict[str, float]]:
        """Sequences of each source in the next batch of ``policy`` and the mixing credit
        after it (committed only when the batch is served).

        The batch's ``need / group_size`` groups are apportioned by largest remainder with
        the remainder carried over: every source earns ``groups x weight / total`` credit
        per batch, each group goes to the source with the most credit (ties: config order)
        and costs it 1. Credits sum to 0 and stay bounded, so over many batches each source
        gets exactly its share, even when a batch's share is not a whole number of groups.
        A part of a group (``need`` not a multiple of the group size, with replay) goes the
        same way, costing its fraction of a group."""
        if len(self.source_weights) == 1:
            return {s: need for s in self.source_weights}, dict(self.mix_credit[policy])
        gs = self.wcfg.group_size
        total_w = sum(self.source_weights.values())
        credit = {s: c + need / gs * self.source_weights[s] / total_w for s, c in self.mix_credit[policy].items()}
        quota = {s: 0 for s in self.source_weights}
        full, rest = divmod(need, gs)
        for n, cost in [(gs, 1.0)] * full + ([(rest, rest / gs)] if rest else []):
            s = max(credit, key=credit.__getitem__)  # first of the largest: config order breaks ties
            quota[s] += n
            credit[s] -= cost
        return quota, credit

    def _lockstep_ok(self, version: int) -> bool:
        return not self.cfg.lockstep or all(v >= version for v in self.versions.values())

    def _initial_eval_done(self) -> bool:
        """Training waits for the first evaluation round, so that it measures exactly the
        starting weights (no newer version exists before the first batch is served)."""
        if not self.eval_rounds:
            return True
        first = self.eval_rounds[min(self.eval_rounds)]
        return first.remaining <= 0

    async def next_batch(self, policy: str, version: int, timeout: float = 60.0) -> Batch:
        """A batch of ``batch_size`` sequences for ``policy`` whose trainer is at ``version``.

        Waits until the buffer holds enough fresh sequences, at most ``timeout`` seconds,
        then raises ``BatchTimeout``."""
        if policy not in self.buffers:
            raise ValueError(f"unknown policy {policy!r}; known: {self.policy_names}")
        t0 = time.time()
        n_replay = int(self.cfg.replay_ratio * self.cfg.batch_size)
        if len(self.replay[policy]) < n_replay:
            n_replay = 0
        need = self.cfg.batch_size - n_replay
        quota, credit = self._quotas(policy, need)
        try:
            while True:
                self._expire()
                self._refill()
                avail = self._available_by_source(policy, version)
                short = {s: q - avail[s] for s, q in quota.items() if avail[s] < q}
                if not short and self._lockstep_ok(version) and self._initial_eval_done():
                    break
                self._short[policy] = short  # lets _refill exceed a source's bound for this batch
                remaining = t0 + timeout - time.time()
                if remaining <= 0:
                    sources = (f" (short: {', '.join(f'source {s!r} {avail[s]}/{quota[s]}' for s in short)})"
                               if self._mixing and short else "")
                    raise BatchTimeout(
                        f"no batch for {policy} v{version} within {timeout:.0f}s: "
                        f"{sum(avail.values())}/{need} sequences buffered{sources}, "
                        f"{len(self.pending)} tasks pending, {len(self.leases)} leased"
                    )
                try:
                    await asyncio.wait_for(self._event().wait(), timeout=min(remaining, 0.5))
                except asyncio.TimeoutError:
                    pass
        finally:
            self._short.pop(policy, None)
        waited = time.time() - t0
        self.wait_s[policy] += waited
        self.mix_credit[policy] = credit

        buf = self.buffers[policy]
        chosen: list[_Item] = []
        for source, q in quota.items():
            mine = [g for g in buf if g.source == source]
            views = [P.BufferedGroupView(g.ingest_seq, g.oldest_version) for g in mine]
            got = 0
            for gi in self.ordering.order(views, version, self.cfg.max_staleness):
                if got >= q:
                    break
                grp = mine[gi]
                take = grp.items[: q - got]
                grp.items = grp.items[len(take):]
                chosen.extend(take)
                got += len(take)
            self.consumed_by_source[policy][source] += got
        self.buffers[policy] = [g for g in buf if g.items]

        rows = await asyncio.to_thread(self._read_rows, [it.summary.ref for it in chosen])
        items: list[BatchItem] = []
        for it, row in zip(chosen, rows):
            seq = sequence_from_stored(row)
            pidx = json.loads(row.meta)["policies"].index(policy)
            items.append(
                BatchItem(
                    sequence=seq,
                    loss_mask=seq.loss_mask & (seq.policy_ids == pidx),
                    group_mean=it.group_mean,
                    group_std=it.group_std,
                    group_size=it.group_size,
                    staleness=version - it.oldest_version,
                    task_id=it.task_id,
                )
            )
        replays = [replace(x, replayed=True, staleness=version - x.sequence.oldest_version)
                   for x in self._rng.sample(list(self.replay[policy]), n_replay)] if n_replay else []
        self.replay[policy].extend(items)
        lost = self.serving[policy].pop(version, None)
        if lost:  # this version asks again: the batch served before never reached its training
            self._settle(policy, lost, "served_not_trained")
        self.serving[policy][version] = chosen  # consumed once the version trained on it is committed
        self._notify()  # room for new groups: wakes the nodes' waiting lease calls

        c = self.counts[policy]
        c["consumed"] += len(items)
        c["replayed"] += len(replays)
        hist = Counter(x.staleness for x in items)
        self.staleness_hist[policy].update(hist)
        rewards = [x.sequence.reward for x in items]
        metrics = {
            "wait_s": waited,
            "reward_mean": float(np.mean(rewards)),
            "staleness_mean": float(np.mean([x.staleness for x in items])),
            "staleness_hist": {str(k): v for k, v in sorted(hist.items())},
            "replayed": len(replays),
            "response_tokens_mean": float(np.mean([x.loss_mask.sum() for x in items])),
        }
        if self._mixing:
            metrics["consumed_by_source"] = dict(quota)
        self.last_batch[policy] = metrics
        return Batch(policy=policy, version=version, items=tuple(items + replays), metrics=metrics)

    async def published(self, policy: str, version: int, metrics: dict[str, Any] | None = None,
                        batch_metrics: dict[str, Any] | None = None) -> None:
        """The trainer of ``policy`` committed ``version``; record its step metrics.

        The metrics line (one per policy and step) holds the trainer's own metrics, the last
        batch's (``data_*``: wait, staleness histogram of the batch, replays), and the
        policy's cumulative dataflow counts: ``accepted`` / ``filtered`` (group filter) /
        ``stale_dropped`` / ``overflow_dropped`` / ``replayed`` / ``consumed`` sequences,
        ``curator_skipped`` prompts (the curator runs before rollout, for all policies:
        counted on the first), ``staleness_hist`` over every consumed sequence,
        ``trainer_wait_s`` and ``rollouts_per_consumed`` (training sequences generated per
        sequence consumed: the price of filtering and staleness), with the policy names.
        With several sources (``mix``): ``consumed_by_source`` (cumulative sequences of each
        source consumed by this policy) and ``groups_by_source`` (train groups created).
        ``batch_metrics``: the ``Batch.metrics`` of the batch this version was trained on (the
        trainer reports a version after it fetched the next batch; without them, the last
        batch served is reported)."""
        self.versions[policy] = max(self.versions[policy], version)
        self._settle(policy, self.serving[policy].pop(version - 1, []), None)  # trained and committed
        c = self.counts[policy]
        elapsed = time.time() - self._started
        record = {
            "step": version,
            "policy": policy,
            "time": elapsed,
            **(metrics or {}),
            **{f"data_{k}": v for k, v in (batch_metrics or self.last_batch[policy]).items()},
            "dataflow": {"curator": self.cfg.curator.type, "group_filter": self.cfg.group_filter.type,
                         "ordering": self.cfg.ordering.type, "replay_ratio": self.cfg.replay_ratio,
                         "max_staleness": self.cfg.max_staleness},
            "accepted": c["accepted"],
            "filtered": c["filtered"],
            "stale_dropped": c["stale_dropped"],
            "overflow_dropped": c["overflow_dropped"],
            "replayed": c["replayed"],
            "consumed": c["consumed"],
            "curator_skipped": c["curator_skipped"],
            "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist[policy].items())},
            "sequences_generated": self.sequences_generated,
            "rollouts_generated": self.train_sequences_generated,
            "rollouts_per_consumed": self.train_sequences_generated / max(c["consumed"], 1),
            "trajectories_per_s": self.sequences_generated / max(elapsed, 1e-9),
            "tokens_per_s": self.tokens_generated / max(elapsed, 1e-9),
            "trainer_wait_s": self.wait_s[policy],
            "node_versions": {n: i.get("versions") for n, i in self.nodes.items() if not i.get("gone")},
        }
        if self._mixing:
            record["consumed_by_source"] = self._consumed_by_source(policy)
            record["groups_by_source"] = self._groups_by_source()
        self._write_metrics(record)
        self._save()
        if all(v >= self.max_steps for v in self.versions.values()):
            self.finished = True
        every = self.wcfg.eval.every
        if policy == self.policy_names[0] and every and (version % every == 0 or version >= self.max_steps):
            self._start_eval(version)
        self._notify()

    def _consumed_by_source(self, policy: str) -> dict[str, int]:
        return {s: self.consumed_by_source[policy][s] for s in self.source_weights}

    def _groups_by_source(self) -> dict[str, int]:
        return {s: self.groups_by_source[s] for s in self.source_weights}

    async def open_iteration(self, groups: int) -> None:
        """Baseline (``run.mode: sync``, a gated data layer) control: allow exactly ``groups``
        more groups to be created."""
        self.budget = (self.budget or 0) + groups
        self._refill()
        self._notify()

    async def ready(self, policy: str, version: int) -> int:
        """Sequences buffered for ``policy`` that a trainer at ``version`` could consume."""
        return self._available(policy, version)

    # ------------------------------------------------------------------ save / restore
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs: the dataflow policies' own state (random streams
        included) with their ``type`` names, the trainers' versions, the prompt order of each
        source and its shuffling stream, and the batch-time mixing credit. Leases and buffers
        are not saved: the tasks of an interrupted run end as ``run_ended`` and are rolled
        out again."""
        version, internal, gauss = self._rng.getstate()
        return {
            "versions": dict(self.versions),
            "policy_types": {"curator": self.cfg.curator.type, "group_filter": self.cfg.group_filter.type,
                             "ordering": self.cfg.ordering.type},
            "curator": self.curator.state_dict(),
            "group_filter": self.group_filter.state_dict(),
            "ordering": self.ordering.state_dict(),
            "order": {s: list(o) for s, o in self._order.items()},
            "epoch": dict(self._epoch),
            "mix_credit": {p: dict(c) for p, c in self.mix_credit.items()},
            "group_seq": self._group_seq,
            "rng_state": [version, list(internal), gauss],
        }

    def _restore(self, state: dict[str, Any]) -> None:
        """Load ``state_dict()``. A policy whose ``type`` changed in the config since the
        state was saved starts fresh (with a warning) instead of loading foreign state."""
        self.versions.update({p: v for p, v in state["versions"].items() if p in self.versions})
        saved_types = state.get("policy_types", {})
        for stage in ("curator", "group_filter", "ordering"):
            current = getattr(self.cfg, stage).type
            if saved_types.get(stage, current) != current:
                log.warning("dataflow.%s changed from %r to %r since the run was saved: it starts fresh",
                            stage, saved_types[stage], current)
                continue
            getattr(self, stage).load_state_dict(state[stage])
        order, epoch = state["order"], state["epoch"]
        if isinstance(order, list):  # saved before sources existed: one source ""
            order, epoch = {"": order}, {"": epoch}
        if set(order) == set(self.source_weights):
            self._order = {s: list(o) for s, o in order.items()}
            self._epoch = {s: int(e) for s, e in epoch.items()}
        else:
            log.warning("workload sources changed from %s to %s since the run was saved: prompt orders "
                        "and mixing credit start fresh", sorted(order), sorted(self.source_weights))
        credit = state.get("mix_credit", {})
        for p, c in credit.items():
            if p in self.mix_credit and set(c) == set(self.mix_credit[p]):
                self.mix_credit[p] = {s: float(x) for s, x in c.items()}
        self._group_seq = state["group_seq"]
        if "rng_state" in state:
            version, internal, gauss = state["rng_state"]
            self._rng.setstate((int(version), tuple(int(x) for x in internal), gauss))

    def _save(self) -> None:
        if self._state_path is None:
            return
        tmp = self._state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state_dict(), default=float))
        tmp.replace(self._state_path)

    # ------------------------------------------------------------------ evaluation
    async def start_eval(self, version: int) -> None:
        """Queue a held-out evaluation of the first policy at ``version`` (idempotent)."""
        self._start_eval(version)

    def _start_eval(self, version: int) -> None:
        if version in self.eval_rounds:
            return
        k = self.wcfg.eval.k
        policy = self.policy_names[0]
        rnd = _EvalRound(version=version, policy=policy, k=k, remaining=len(self._eval) * k)
        self.eval_rounds[version] = rnd
        sampling = {"greedy": True} if k == 1 else None
        for i, payload in enumerate(self._eval):
            gid = f"eval-v{version}-{i}"
            rnd.sources[gid] = self._source_of(payload)
            for j in range(k):
                tid = f"{gid}/{j}"
                self._add_task(
                    RolloutTask(
                        task_id=tid, group_id=gid, policies=tuple(self.policy_names),
                        workflow=self.wcfg.workflow, prompt=payload, kind="eval",
                        sampling=sampling, min_version=version,
                    )
                )
                self.eval_pending.append(tid)

    def _record_eval(self, task: RolloutTask, ref: TrajectoryRef) -> None:
        rnd = self.eval_rounds[task.min_version]
        rnd.rewards.setdefault(task.group_id, []).append(ref.score)
        first = self.policy_names[0]
        rnd.versions_used += [s.policy_tokens[first][1] for s in ref.sequences if first in s.policy_tokens]
        rnd.remaining -= 1
        self.ledger.end(task.task_id, "evaluated")
        self._maybe_finish_eval(task.min_version)

    def _maybe_finish_eval(self, version: int) -> None:
        rnd = self.eval_rounds[version]
        if rnd.remaining > 0:
            return
        per_prompt = list(rnd.rewards.values())
        avg = float(np.mean([np.mean(r) for r in per_prompt])) if per_prompt else 0.0
        pass_k = float(np.mean([max(r) > 0 for r in per_prompt])) if per_prompt else 0.0
        result = {
            "step": version,
            "policy": rnd.policy,
            "time": time.time() - self._started,
            "eval_accuracy": avg,
            f"eval_avg@{rnd.k}": avg,
            f"eval_pass@{rnd.k}": pass_k,
            "eval_prompts": len(per_prompt),
            # an evaluation requested at v runs on v or newer weights (nodes never go back);
            # the first one gates training, so it always runs on exactly the starting weights
            "eval_version_min": min(rnd.versions_used, default=version),
            "eval_version_max": max(rnd.versions_used, default=version),
            "eval_seconds": time.time() - rnd.started,
        }
        if len(self.source_weights) > 1:
            by_source: dict[str, list[float]] = {}
            for gid, r in rnd.rewards.items():
                by_source.setdefault(rnd.sources[gid], []).append(float(np.mean(r)))
            result["eval_accuracy_by_source"] = {s: float(np.mean(v)) for s, v in by_source.items()}
        rnd.result = result
        self._write_evals()

    def _write_evals(self, past_unfinished: bool = False) -> None:
        """Write finished evaluation records in version order: rounds overlap and a later one
        can finish first, so it waits for the earlier ones unless ``past_unfinished`` (at the
        end of the run, when an unfinished round never will)."""
        for r in sorted(self.eval_rounds.values(), key=lambda r: r.version):
            if r.written:
                continue
            if r.result is None:
                if past_unfinished:
                    continue
                break
            r.written = True
            self.eval_results.append(r.result)
            self._write_metrics(r.result)

    # ------------------------------------------------------------------ orchestrator-facing
    async def finish(self) -> dict[str, Any]:
        """End the run: every task that has not ended is dropped with reason ``run_ended``.
        Afterwards every task in the ledger has ended exactly once."""
        self.finished = True
        self._write_evals(past_unfinished=True)  # rounds held back behind an unfinished one were measured
        for policy, buf in self.buffers.items():
            for grp in buf:
                self._settle(policy, grp.items, "run_ended")
            buf.clear()
            for served in self.serving[policy].values():  # fetched by a trainer, never committed
                self._settle(policy, served, "served_not_trained")
            self.serving[policy].clear()
        for tid, rec in list(self.ledger.tasks.items()):
            if rec.state in TERMINAL:
                continue
            if tid in self.routed_left:  # completed, buffered for a policy that was cleared above
                continue
            self.leases.pop(tid, None)
            self.tasks.pop(tid, None)
            if rec.state != "completed":
                self.ledger.events["abandoned_" + rec.state] += 1
            self.ledger.end(tid, "dropped", "run_ended")
        self.pending.clear()
        self.eval_pending.clear()
        if self._metrics is not None:
            self._metrics.flush()
        return self.ledger.summary()

    async def eval_done(self, version: int) -> bool:
        rnd = self.eval_rounds.get(version)
        return rnd is not None and rnd.written

    async def progress(self) -> dict[str, int]:
        """Cheap counters for pollers that only need to know how far the run is."""
        return {"sequences_generated": self.sequences_generated, "tokens_generated": self.tokens_generated,
                **{f"version_{p}": v for p, v in self.versions.items()}}

    async def state(self) -> dict[str, Any]:
        """A JSON-able snapshot for ``astraflow status``, the dashboard and tests."""
        elapsed = time.time() - self._started
        held = Counter(node for node, _ in self.leases.values())
        return {
            "elapsed_s": elapsed,
            "finished": self.finished,
            "versions": dict(self.versions),
            "pending": len(self.pending),
            "eval_pending": len(self.eval_pending),
            "leased": len(self.leases),
            "outstanding_groups": len(self._outstanding),
            "sources": {s: {"weight": w, "groups_created": self.groups_by_source[s],
                            "consumed": {p: self.consumed_by_source[p][s] for p in self.policy_names},
                            "mix_credit": {p: self.mix_credit[p][s] for p in self.policy_names}}
                        for s, w in self.source_weights.items()},
            "buffers": {p: sum(len(g.items) for g in b) for p, b in self.buffers.items()},
            "counts": {p: dict(c) for p, c in self.counts.items()},
            "staleness_hist": {p: {str(k): v for k, v in sorted(h.items())} for p, h in self.staleness_hist.items()},
            "trainer_wait_s": dict(self.wait_s),
            "sequences_generated": self.sequences_generated,
            "tokens_generated": self.tokens_generated,
            "trajectories_per_s": self.sequences_generated / max(elapsed, 1e-9),
            "tokens_per_s": self.tokens_generated / max(elapsed, 1e-9),
            "nodes": {n: {**i, "leases_held": held.get(n, 0)} for n, i in self.nodes.items()},
            "eval": list(self.eval_results),
            "ledger": self.ledger.summary(),
            "policies_state": {
                "curator": self.curator.state_dict(),
                "group_filter": self.group_filter.state_dict(),
            },
        }

    async def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
