"""Buffers and batch assembly: from a finished group of rollouts to the batch a trainer uses.

A train group is rolled out (``rolling``), then ingested when all its tasks ended: per policy,
the sequences carrying that policy's tokens, with the group's reward statistics, pass the group
filter into that policy's buffer (``ready``). A batch takes sequences from the buffer in the
configured ordering, adds replayed ones, and is *served*; its tasks are *consumed* only when the
trainer commits the version trained on it (``commit``). Each routed sequence is settled exactly
once (consumed or dropped with a reason); a task ends in the ``Ledger`` when all its sequences
are settled.

Named asynchronous overlap, *staleness*: a sequence whose oldest token version for the consuming
policy is more than ``max_staleness`` versions behind the trainer's version is dropped and
counted as ``stale`` (``drop_stale``, just before a batch is assembled), so no batch holds a
sequence older than the bound, however far rollouts ran ahead. Replayed sequences are held to
the same bound.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from astraflow.batches import BatchRefs, RowRef, group_stats
from astraflow.contracts import SequenceSummary, TrajectoryRef
from astraflow.dataflow.ledger import Ledger
from astraflow.dataflow.rules import BufferedGroupView, GroupFilter, GroupView, Ordering, keep_group


@dataclass
class RolloutGroup:
    """A train group being rolled out: its tasks and those that completed or failed."""

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
class Item:
    """A sequence routed to one policy's buffer, waiting to be consumed."""

    task_id: str
    summary: SequenceSummary
    oldest_version: int
    group_mean: float
    group_std: float
    group_size: int
    #: where it came from in the buffer (a batch that never trained puts it back there)
    group_id: str = ""
    source: str = ""
    ingest_seq: int = 0
    #: the RaaS node that generated it (per-node staleness of what is consumed)
    node: str = ""


def row_ref(it: Item, staleness: int, replayed: bool = False) -> RowRef:
    """What a trainer needs of ``it`` besides its stored row."""
    return RowRef(ref=it.summary.ref, task_id=it.task_id, reward=it.summary.reward, group_mean=it.group_mean,
                  group_std=it.group_std, group_size=it.group_size, staleness=staleness, replayed=replayed)


@dataclass
class ReadyGroup:
    """A group's sequences of one policy in its buffer."""

    group_id: str
    ingest_seq: int
    items: list[Item]
    source: str = ""

    @property
    def oldest_version(self) -> int:
        return min(i.oldest_version for i in self.items)


class Buffers:
    """Groups in rollout, per-policy buffers, served batches, replay and batch statistics."""

    def __init__(self, policies: list[str], *, batch_size: int, group_size: int, limit: int | Callable[[], int],
                 max_staleness: int, ledger: Ledger, rng: random.Random,
                 consuming: Callable[[str], bool] = lambda policy: False, replay: bool = True):
        self.policies = list(policies)
        self.group_size = group_size
        #: the groups allowed ahead of training, now (it grows with the nodes' slots)
        self._limit = limit if callable(limit) else (lambda: limit)
        #: whether a policy's trainer consumes (waits for or recently asked for batches)
        self._consuming = consuming
        self.max_staleness = max_staleness
        self.ledger = ledger
        #: draws replayed samples (shared with the prompt orders: one stream, saved with the run)
        self.rng = rng
        #: train groups being rolled out (not yet ingested), by group id
        self.rolling: dict[str, RolloutGroup] = {}
        #: groups in ``rolling`` per source, kept in step with it (``rolling_by_source``)
        self._rolling_count: Counter = Counter()
        self.group_seq = 0
        #: train groups that finished rollout (kept or not): what admission divides yields by
        self.groups_ingested = 0
        self.ready: dict[str, list[ReadyGroup]] = {p: [] for p in self.policies}
        #: per policy: items consumed (their version committed), which replay may serve again
        #: (``replay_ratio``) while they are within ``max_staleness``; kept only with ``replay``
        self.replay: dict[str, deque[Item]] = {p: deque(maxlen=4 * batch_size if replay else 0)
                                               for p in self.policies}
        #: per policy: the items of the batch served to a trainer at version v, by v, until the
        #: trainer reports v + 1 committed (``commit``): only then are they consumed
        self.serving: dict[str, dict[int, list[Item]]] = {p: {} for p in self.policies}
        #: per policy: the rows replayed in the batch served at version v, by v (taken back with it)
        self.served_replays: dict[str, dict[int, int]] = {p: {} for p in self.policies}
        self.routed_left: dict[str, int] = {}  # train task -> items not yet settled
        self.task_consumed: set[str] = set()
        self.task_drop_reason: dict[str, str] = {}
        self.counts: dict[str, Counter] = {p: Counter() for p in self.policies}
        self.staleness_hist: dict[str, Counter] = {p: Counter() for p in self.policies}
        #: per node: consumed sequences by staleness (versions behind), all policies together; saved
        #: (``changes.py``), so that it counts over the whole run
        self.staleness_by_node: dict[str, Counter] = {}
        self.wait_s: dict[str, float] = {p: 0.0 for p in self.policies}
        self.last_batch: dict[str, dict[str, Any]] = {p: {} for p in self.policies}
        self._ingest_seq = 0
        #: what changed since the data layer's change log last took it (None: not kept;
        #: ``changes.py``): ``("route", task)``, ``("group", group)`` (ingested), ``("ready", policy, ingest_seq)``,
        #: ``("serving", policy, version)``, ``("staleness", node)``
        self.changed: set[tuple] | None = None

    @property
    def cap_groups(self) -> int:
        """A policy whose trainer does not consume keeps at most this many groups."""
        return 4 * self._limit()

    def _touch(self, *key: Any) -> None:
        if self.changed is not None:
            self.changed.add(key)

    # -- before ingest -----------------------------------------------------------------------
    def open_group(self, prompt_key: str, source: str) -> RolloutGroup:
        """A new train group of ``group_size`` tasks, in rollout."""
        self.group_seq += 1
        gid = f"g{self.group_seq:07d}"
        grp = RolloutGroup(gid, prompt_key, "train", [f"{gid}/{j}" for j in range(self.group_size)], source)
        self.rolling[gid] = grp
        self._rolling_count[source] += 1
        return grp

    def rolling_by_source(self) -> Counter:
        """Groups in rollout per source, without a pass over them (recounted only when
        ``rolling`` was replaced or cleared behind this room's back: a restore, the run's end)."""
        if sum(self._rolling_count.values()) != len(self.rolling):
            self._rolling_count = Counter(g.source for g in self.rolling.values())
        return self._rolling_count

    def groups_ahead(self, sources: Sequence[str]) -> dict[str, int]:
        """Groups the hungriest policy has buffered, per source."""
        return {s: min(sum(1 for g in b if g.source == s) for b in self.ready.values()) for s in sources}

    # -- ingest ------------------------------------------------------------------------------
    def ingest(self, grp: RolloutGroup, group_filter: GroupFilter) -> tuple[list[float], list[float]]:
        """A finished group enters the buffers (see the module docstring); returns the first
        policy's rewards and, per sequence, its episode's success (a multi-turn episode's
        ``success``, else the reward): what the curator observes (``observes``; empty if it
        generated nothing)."""
        if self.rolling.pop(grp.group_id, None) is not None:
            self._rolling_count[grp.source] -= 1
            self._touch("group", grp.group_id)
        self.groups_ingested += 1
        live = [t for t in grp.task_ids if t in grp.results]
        for tid in live:
            self.routed_left[tid] = 0
        routed: list[tuple[str, list[Item], list[float]]] = []
        for policy in self.policies:
            items: list[Item] = []
            rewards: list[float] = []
            for tid in live:
                for s in grp.results[tid].sequences:
                    if policy in s.policy_tokens and s.policy_tokens[policy][0] > 0:
                        items.append(Item(tid, s, s.policy_tokens[policy][1], 0.0, 0.0, 0,
                                          node=grp.results[tid].node))
                        rewards.append(s.reward)
            if items:
                routed.append((policy, items, rewards))
                for it in items:  # every policy's items are counted before any is settled (which may end the task)
                    self.routed_left[it.task_id] += 1
        first_rewards: list[float] = []
        first_success: list[float] = []
        for policy, items, rewards in routed:
            if policy == self.policies[0]:
                first_rewards = rewards
                first_success = [float(grp.results[it.task_id].stats.get("success", it.summary.reward))
                                 for it in items]
            c = self.counts[policy]
            c["sequences_ingested"] += len(items)
            if len(items) < 2:
                self.settle(policy, items, "group_incomplete")
                continue
            keep, reason = keep_group(group_filter, rewards, GroupView(
                policy, grp.source, tuple(it.summary.finish_reason for it in items),
                tuple(it.summary.num_tokens for it in items),
                tuple(it.summary.policy_tokens[policy][0] for it in items)))
            if not keep:
                c["filtered"] += len(items)
                self.settle(policy, items, reason or "filtered")
                continue
            mean, std = group_stats(rewards)
            self._ingest_seq += 1
            for it in items:
                it.group_mean, it.group_std, it.group_size = mean, std, len(items)
                it.group_id, it.source, it.ingest_seq = grp.group_id, grp.source, self._ingest_seq
            self.ready[policy].append(ReadyGroup(grp.group_id, self._ingest_seq, items, grp.source))
            self._touch("ready", policy, self._ingest_seq)
            c["accepted"] += len(items)
            self.cap(policy)
        for tid in live:
            if self.routed_left.get(tid) == 0:
                self._end_task(tid, "no_policy_tokens")
        return first_rewards, first_success

    def cap(self, policy: str) -> None:
        """A policy whose trainer does not consume keeps at most ``cap_groups`` groups; the
        oldest beyond that are dropped as ``overflow``. A consuming trainer's buffer is bounded
        by admission and drained by its batches (a cap there, falling with the nodes' slots or
        counting groups of few sequences, would drop what its next batch needs)."""
        if self._consuming(policy):
            return
        buf = self.ready[policy]
        while len(buf) > self.cap_groups:
            grp = buf.pop(0)
            self._touch("ready", policy, grp.ingest_seq)
            self.counts[policy]["overflow_dropped"] += len(grp.items)
            self.settle(policy, grp.items, "overflow")

    def settle(self, policy: str, items: list[Item], drop_reason: str | None) -> None:
        """Items leave a buffer: consumed (``drop_reason`` None) or dropped."""
        for it in items:
            self._touch("route", it.task_id)
            if drop_reason is None:
                self.task_consumed.add(it.task_id)
            else:
                self.task_drop_reason.setdefault(it.task_id, drop_reason)
            self.routed_left[it.task_id] -= 1
            if self.routed_left[it.task_id] == 0:
                self._end_task(it.task_id, self.task_drop_reason.get(it.task_id, "unknown"))

    def _end_task(self, tid: str, reason: str) -> None:
        self.routed_left.pop(tid, None)
        if tid in self.task_consumed:
            self.task_consumed.discard(tid)
            self.ledger.end(tid, "consumed")
        else:
            self.ledger.end(tid, "dropped", reason)
        self.task_drop_reason.pop(tid, None)

    # -- batches -----------------------------------------------------------------------------
    def fresh(self, it: Item, version: int) -> bool:
        """Whether a trainer at ``version`` may take ``it``: sampled at most ``max_staleness`` versions
        before it, and not after it (by a version moved aside, behind which the trainer resumed)."""
        return 0 <= version - it.oldest_version <= self.max_staleness

    def drop_stale(self, policy: str, version: int) -> int:
        """Drop (and settle) the buffer's sequences too stale for a trainer at ``version``; how
        many are left to serve."""
        buf = self.ready[policy]
        total = 0
        for grp in list(buf):
            stale = [it for it in grp.items if not self.fresh(it, version)]
            if stale:
                self._touch("ready", policy, grp.ingest_seq)
                self.counts[policy]["stale_dropped"] += len(stale)
                grp.items = [it for it in grp.items if it not in stale]
                self.settle(policy, stale, "stale")
            if not grp.items:
                buf.remove(grp)
            total += len(grp.items)
        return total

    def drop_stale_by_source(self, policy: str, version: int, sources: Sequence[str]) -> dict[str, int]:
        """``drop_stale``, with what is left counted per source."""
        self.drop_stale(policy, version)
        out = {s: 0 for s in sources}
        for grp in self.ready[policy]:
            out[grp.source] += len(grp.items)
        return out

    def take(self, policy: str, quota: dict[str, int], ordering: Ordering, version: int
             ) -> tuple[list[Item], dict[str, int]]:
        """Take each source's quota of items from the buffer in ``ordering``'s order; the
        items and how many of each source were taken."""
        buf = self.ready[policy]
        chosen: list[Item] = []
        taken: dict[str, int] = {}
        for source, q in quota.items():
            mine = [g for g in buf if g.source == source]
            views = [BufferedGroupView(g.ingest_seq, g.oldest_version) for g in mine]
            got = 0
            order = list(ordering.order(views, version, self.max_staleness))
            if sorted(order) != list(range(len(views))):
                raise ValueError(
                    f"dataflow.ordering {type(ordering).__name__}.order returned {len(order)} indices for {len(views)} "
                    "buffered groups, not each index once: an ordering only orders the buffer (every index "
                    "0..n-1 once); leave groups out with dataflow.group_filter or max_staleness instead")
            for gi in order:
                if got >= q:
                    break
                grp = mine[gi]
                take = grp.items[: q - got]
                grp.items = grp.items[len(take):]
                self._touch("ready", policy, grp.ingest_seq)
                chosen.extend(take)
                got += len(take)
            taken[source] = got
        self.ready[policy] = [g for g in buf if g.items]
        return chosen, taken

    def serve(self, policy: str, version: int, chosen: list[Item], n_replay: int,
              waited: float, by_source: dict[str, int] | None) -> BatchRefs:
        """The batch of ``chosen`` items plus ``n_replay`` replayed ones, by reference (the
        trainer reads the rows: no token array is read here), recorded as served to
        ``policy``'s trainer at ``version``. A batch served before at the same version never
        reached its training: it is dropped (``served_not_trained``)."""
        items = [row_ref(it, version - it.oldest_version) for it in chosen]
        n_replay = min(n_replay, self.replayable(policy, version)) if n_replay else 0
        replays = [row_ref(it, version - it.oldest_version, replayed=True)
                   for it in self.rng.sample(list(self.replay[policy]), n_replay)] if n_replay else []
        self.drop_served(policy, version)
        self._touch("serving", policy, version)
        self.serving[policy][version] = chosen  # consumed once the version trained on it is committed
        if replays:
            self.served_replays[policy][version] = len(replays)

        hist = Counter(x.staleness for x in items)  # counted as consumed once trained on (``commit``)
        metrics = {
            "wait_s": waited,
            "reward_mean": float(np.mean([x.reward for x in items])),
            "staleness_mean": float(np.mean([x.staleness for x in items])),
            "staleness_hist": {str(k): v for k, v in sorted(hist.items())},
            "replayed": len(replays),
            # the policy's generated tokens: the loss mask the trainer will apply
            "response_tokens_mean": float(np.mean([it.summary.policy_tokens[policy][0] for it in chosen])),
        }
        if by_source is not None:
            metrics["consumed_by_source"] = dict(by_source)
        self.last_batch[policy] = metrics
        return BatchRefs(policy=policy, version=version, items=tuple(items + replays), metrics=metrics)

    def replayable(self, policy: str, version: int) -> int:
        """How many items of ``policy``'s replay pool a batch at ``version`` may replay: those
        within ``max_staleness`` of it (older ones leave the pool: they only get older)."""
        pool = self.replay[policy]
        if not all(self.fresh(it, version) for it in pool):
            self.replay[policy] = pool = deque((it for it in pool if self.fresh(it, version)), maxlen=pool.maxlen)
        return len(pool)

    def drop_served(self, policy: str, version: int) -> list[Item]:
        """A batch is served at ``version`` again while the one served before at it is still
        held (the data layer's ``next_batch`` puts that one back first): it never reached its
        training. Its items are dropped (``served_not_trained``) and what serving counted for
        them is taken back. Returns the items."""
        lost = self.serving[policy].pop(version, None)
        if not lost:
            return []
        self._touch("serving", policy, version)
        self.served_replays[policy].pop(version, None)
        self.settle(policy, lost, "served_not_trained")
        return lost

    def commit(self, policy: str, version: int) -> list[Item]:
        """``policy``'s trainer committed ``version``: the batch served at ``version - 1`` is
        consumed (counted: ``consumed``, ``replayed``, ``staleness_hist`` say what was trained on,
        not what a trainer holds untrained), and replay may serve its items again. Returns them."""
        items = self.serving[policy].pop(version - 1, [])
        c = self.counts[policy]
        c["consumed"] += len(items)
        c["replayed"] += self.served_replays[policy].pop(version - 1, 0)
        self.staleness_hist[policy].update(Counter(version - 1 - it.oldest_version for it in items))
        self._touch("serving", policy, version - 1)
        for it in items:
            self.staleness_by_node.setdefault(it.node, Counter())[version - 1 - it.oldest_version] += 1
        for node in {it.node for it in items}:
            self._touch("staleness", node)
        self.replay[policy].extend(items)
        self.settle(policy, items, None)
        return items

    def put_back(self, policy: str, from_version: int) -> list[Item]:
        """``policy``'s trainer was lost and a new one resumes from the committed ``from_version``:
        every batch served at ``from_version`` or later never reached a committed version, so
        its items return to the buffer, in their groups and ingest order, to be served again
        (not dropped as ``served_not_trained``; they may still age past ``max_staleness`` and
        be dropped as ``stale``, counted). Returns the items."""
        back: list[Item] = []
        for v in sorted(v for v in self.serving[policy] if v >= from_version):
            items = self.serving[policy].pop(v)
            self._touch("serving", policy, v)
            self.served_replays[policy].pop(v, None)
            back += items
        self.counts[policy]["put_back"] += len(back)
        if back:
            self.restore(policy, back)
        return back

    def restore(self, policy: str, items: list[Item]) -> None:
        """Items taken from ``policy``'s buffer but never trained on return to it, each into its
        group (re-created if the rest of it left), the groups in ingest order."""
        groups = {g.ingest_seq: g for g in self.ready[policy]}
        for it in items:
            self._touch("ready", policy, it.ingest_seq)
            grp = groups.get(it.ingest_seq)
            if grp is None:
                grp = groups[it.ingest_seq] = ReadyGroup(it.group_id, it.ingest_seq, [], it.source)
            grp.items.append(it)
        self.ready[policy] = sorted(groups.values(), key=lambda g: g.ingest_seq)

    def end_run(self, keep_served: bool = False) -> None:
        """Every buffered item is dropped (``run_ended``), every served batch never committed
        too (``served_not_trained``), unless ``keep_served``: the run stopped before its end and
        is to be resumed. The buffers and those batches then stay, their tasks open: the resume
        trains the buffered groups, and the resumed trainer's ``put_back`` returns the batches
        to the buffer, as after a killed run."""
        for policy, buf in self.ready.items():
            if keep_served:
                continue
            for grp in buf:
                self._touch("ready", policy, grp.ingest_seq)
                self.settle(policy, grp.items, "run_ended")
            buf.clear()
            for version, served in self.serving[policy].items():
                self._touch("serving", policy, version)
                self.settle(policy, served, "served_not_trained")
            self.serving[policy].clear()

    def status(self) -> dict[str, Any]:
        return {
            "buffers": {p: sum(len(g.items) for g in b) for p, b in self.ready.items()},
            "counts": {p: dict(c) for p, c in self.counts.items()},
            "staleness_hist": {p: {str(k): v for k, v in sorted(h.items())} for p, h in self.staleness_hist.items()},
            "trainer_wait_s": dict(self.wait_s),
            "consumed_staleness_by_node": {n: {str(k): v for k, v in sorted(h.items())}
                                           for n, h in self.staleness_by_node.items()},
        }
