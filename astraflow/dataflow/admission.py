"""Admission by version: a new group is rolled out only if it can still be trained on.

Every sequence older than ``max_staleness`` versions when its trainer takes it is dropped:
rollout compute paid for nothing. The data layer therefore starts a new group (of a source)
only when, for every policy whose trainer is active, the group can arrive in a batch it may
still train on.

Named asynchronous overlap, *admission vs staleness*. For policy ``p``:

* ``next``: the version whose batch ``p``'s trainer takes next (its version, or one past the
  batch it is training on now);
* ``oldest``: the oldest weight version of ``p`` among the RaaS nodes that lease (a node
  samples with the weights it holds, so no token of the new group is older);
* ``per_batch``: new sequences of the group's source in one batch of ``p`` (the batch size less
  its replayed share, times the source's mixing weight);
* ``ahead``: sequences of the source that ``p`` takes before the new group's: those buffered
  for ``p`` plus those the groups in rollout will bring (groups x the sequences an ingested
  group has given ``p`` on average, so groups a filter drops count for what they yield).

Batches take buffered groups oldest first, so the new group's last sequence is taken at about
``next + floor((ahead + per_group - 1) / per_batch)``, and the group is admitted when that,
less ``oldest``, is at most ``max_staleness``. A policy that finished, whose trainer has not asked for a batch
yet, or stopped asking (``TrainerPace.active``), does not hold the others back. A batch a
trainer waits for has nothing ahead of it, so its groups are admitted as soon as the nodes
hold weights at most ``max_staleness`` versions old (nodes load every committed version, so
this cannot deadlock); before that, whatever they generated would be dropped. The
``prefetch_groups`` bound on groups ahead still applies on top (a waiting batch may exceed it).

*A waiting batch.* When a trainer waits for sequences of a source that the groups in rollout
will not bring (``waiting``: the batch's quota of the source), only the waiting policies are
asked, and for them the batch takes ``quota`` of the group's sequences at ``next``; the rest
spill into the batches after it. The usual estimate would refuse groups a batch cannot form
without: a source whose share is a fraction of a group, a replay-heavy batch (planned with
its replayed share, served new groups when the replay buffer is short), or a policy that waits
in lockstep on another whose bound is full. With nothing ahead, the group is admitted even if
its spill would age past the bound: the batch needs it, and only the spill is lost.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from astraflow.contracts import RolloutTask
from astraflow.dataflow.mixing import prompt_key


@dataclass
class PolicyClock:
    """What admission knows of one policy's trainer and buffer."""

    #: the version whose batch the trainer takes next
    next_version: int
    #: source -> sequences buffered for the policy
    buffered: dict[str, int]
    #: new (not replayed) sequences in one batch
    per_batch: float
    #: sequences one ingested group gives the policy, on average (after the group filter)
    per_group: float
    #: the oldest version of the policy's weights among the leasing nodes (None: no node known)
    oldest_node_version: int | None
    #: whether the policy's trainer still takes batches (not finished, not stalled)
    active: bool = True
    #: the policy's name (matched against ``admits``'s ``waiting``)
    policy: str = ""


def admits(source: str, share: float, rolling: int, clocks: list[PolicyClock], max_staleness: int,
           waiting: Mapping[str, int] | None = None) -> bool:
    """Whether a new group of ``source`` (``share`` of each batch; ``rolling`` groups of it in
    rollout) can still be trained on by every active policy, or, given ``waiting`` (policy ->
    the quota of ``source`` in the batch its trainer waits for), by every waiting policy (see
    the module docstring)."""
    for c in clocks:
        if not c.active or (waiting and c.policy not in waiting):
            continue
        per_batch = max(c.per_batch * share, 1e-9)
        ahead = c.buffered.get(source, 0) + rolling * c.per_group
        if waiting:
            # the waiting batch takes its quota; the rest spills into the batches after it
            spill = ahead + c.per_group - waiting[c.policy]
            taken_at = c.next_version + (0 if spill <= 0 else 1 + math.floor((spill - 1) / per_batch))
            if not ahead and taken_at - c.next_version > max_staleness:
                taken_at = c.next_version  # the batch cannot form without it
        else:
            # the batch that takes the new group's last sequence (a group whose yield varies,
            # a multi-turn episode's, may otherwise spill into a batch past the bound)
            taken_at = c.next_version + math.floor(max(ahead + c.per_group - 1, 0) / per_batch)
        oldest = c.next_version if c.oldest_node_version is None else min(c.oldest_node_version, c.next_version)
        if taken_at - oldest > max_staleness:
            return False
    return True


@dataclass
class TrainerPace:
    """When a policy's trainer last asked for a batch, to tell a slow trainer from a stopped one."""

    last_ask: float | None = None
    waiting: int = 0
    #: moving average of the seconds between two requests
    interval: float = 0.0
    #: a trainer silent this long (and at least this many intervals) counts as stalled
    stall_floor_s: float = 30.0
    stall_intervals: float = 4.0

    def asked(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        if self.last_ask is not None:
            gap = now - self.last_ask
            self.interval = gap if self.interval == 0.0 else 0.8 * self.interval + 0.2 * gap
        self.last_ask = now

    def active(self, now: float | None = None) -> bool:
        """Waiting for a batch, or asked for one within what its pace explains. A trainer that
        has not asked yet (still loading) or went silent (stopped) holds no one back."""
        if self.waiting:
            return True
        if self.last_ask is None:
            return False
        now = time.time() if now is None else now
        return now - self.last_ask <= max(self.stall_floor_s, self.stall_intervals * self.interval)


def clocks(*, policies: list[str], versions: Mapping[str, int], served: Mapping[str, list[int]],
           ready: Mapping[str, list], accepted: Mapping[str, int], groups_ingested: int, group_size: int,
           per_batch: float, nodes: Mapping[str, Mapping[str, Any]], node_window_s: float,
           paces: Mapping[str, TrainerPace], finished: Mapping[str, bool], now: float,
           oldest: Mapping[str, int | None] | None = None) -> list[PolicyClock]:
    """One ``PolicyClock`` per policy from the data layer's state: ``served`` (versions whose
    batch a trainer holds or is being handed), ``ready`` (buffered groups, each with ``source`` and ``items``),
    ``accepted`` (sequences kept per policy), ``nodes`` (``versions``, ``last_seen``,
    ``draining`` per node; nodes not seen within ``node_window_s`` are ignored), or ``oldest``
    (``oldest_versions`` of them, kept by the caller)."""
    if oldest is None:
        oldest = oldest_versions(policies, nodes, node_window_s, now)
    out = []
    for p in policies:
        buffered: dict[str, int] = {}
        for grp in ready[p]:
            buffered[grp.source] = buffered.get(grp.source, 0) + len(grp.items)
        out.append(PolicyClock(
            next_version=max(int(versions[p]), max(served[p], default=-1) + 1),
            buffered=buffered,
            per_batch=per_batch,
            per_group=accepted.get(p, 0) / groups_ingested if groups_ingested else float(group_size),
            oldest_node_version=oldest[p],
            active=not finished[p] and paces[p].active(now),
            policy=p,
        ))
    return out


def oldest_versions(policies: list[str], nodes: Mapping[str, Mapping[str, Any]], node_window_s: float,
                    now: float) -> dict[str, int | None]:
    """Per policy, the oldest weight version among the nodes that lease (not draining, not
    gone, seen within ``node_window_s``); None when no such node reported one. A worker's
    lease stock stands for its nodes (``stocked``): it reports the oldest version they asked
    with, fresher than their heartbeats."""
    live = [n for n in nodes.values() if n.get("versions") and not n.get("draining") and not n.get("gone")
            and not n.get("stocked") and now - float(n.get("last_seen", 0.0)) <= node_window_s]
    out: dict[str, int | None] = {}
    for p in policies:
        held = [int(n["versions"][p]) for n in live if p in n["versions"]]
        out[p] = max(min(held), 0) if held else None
    return out


class OldestVersions:
    """``oldest_versions`` of a data layer's nodes without a pass over every node per call: a
    node reporting an older version lowers it at once, and it is recounted (and may rise) at
    most every ``every_s`` seconds. Between recounts it can only be lower than the truth, so
    admission errs on refusing."""

    def __init__(self, policies: list[str], every_s: float = 0.2):
        self.policies, self.every_s = list(policies), every_s
        self._value: dict[str, int | None] = {p: None for p in policies}
        self._at = float("-inf")

    def saw(self, versions: Mapping[str, int] | None) -> None:
        """A node reported the versions it holds."""
        for p, v in (versions or {}).items():
            if p in self._value:
                cur, v = self._value[p], max(int(v), 0)
                self._value[p] = v if cur is None else min(cur, v)

    def get(self, nodes: Mapping[str, Mapping[str, Any]], node_window_s: float, now: float) -> dict[str, int | None]:
        if now - self._at > self.every_s:
            self._value, self._at = oldest_versions(self.policies, nodes, node_window_s, now), now
        return self._value


Rule = Callable[[str, float, int, "Mapping[str, int] | None"], bool]


def rule_of(layer: Any) -> Rule:
    """``admits(source, share, rolling, waiting)`` over the clocks of a ``DataLayer`` at this moment."""
    cfg, buffers = layer.cfg, layer.buffers
    # new rows a batch takes: fewer by the replayed ones only when the pool can give them all
    # (``next_batch`` replays all or none); planning with replays the pool lacks would refuse
    # the groups the next batch needs
    replays = cfg.replay_rows
    if replays and any(buffers.replayable(p, layer.versions[p]) < replays for p in layer.policy_names):
        replays = 0
    cl = clocks(
        policies=layer.policy_names, versions=layer.versions, ready=buffers.ready,
        served={p: list(buffers.serving[p]) for p in layer.policy_names},
        accepted={p: c["accepted"] for p, c in buffers.counts.items()}, groups_ingested=buffers.groups_ingested,
        group_size=layer.wcfg.group_size, per_batch=cfg.batch_size - replays,
        nodes=layer.leases.nodes, node_window_s=cfg.lease_seconds, paces=layer.paces,
        finished={p: v >= layer.max_steps for p, v in layer.versions.items()}, now=time.time(),
        oldest=layer.oldest.get(layer.leases.nodes, cfg.lease_seconds, time.time()))
    return lambda source, share, rolling, waiting=None: admits(source, share, rolling, cl, cfg.max_staleness,
                                                               waiting)


def _lazy_rule(layer: Any) -> Rule:
    """``rule_of(layer)``, built on its first use."""
    built: list[Rule] = []

    def admits_now(source: str, share: float, rolling: int, waiting: Mapping[str, int] | None = None) -> bool:
        if not built:
            built.append(rule_of(layer))
        return built[0](source, share, rolling, waiting)

    return admits_now


def lags(held: Mapping[str, int] | None, committed: Mapping[str, int]) -> bool:
    """Whether a node holding versions ``held`` is behind a committed version of its policies."""
    held = held or {}
    return any(int(held.get(p, v)) < v for p, v in committed.items())


def refill(layer: Any) -> None:
    """Create train groups of ``layer`` (a ``DataLayer``) while the rollout-ahead bound allows
    (``Mixer.pick_source``) and, with ``admission: version``, this module's rule admits them,
    each from the next prompt of its source that the curator accepts."""
    mixer, buffers, first = layer.mixer, layer.buffers, layer.policy_names[0]
    proposals = 0
    # versions, served batches, buffers and nodes do not change during a refill (only the
    # groups in rollout do, and they are passed separately): one rule for the whole call,
    # built when a source below its bound first asks (most calls find every source at it)
    # the baseline (gated) opens one batch at a time, trained on at once: nothing to refuse
    admits_now = _lazy_rule(layer) if layer.cfg.admission == "version" and layer.budget is None else None
    ahead = buffers.groups_ahead(mixer.weights)  # the buffers do not change here either
    while not layer.finished and proposals < max(len(layer._train), 1):
        rolling = buffers.rolling_by_source()
        if layer.budget_sources is not None:
            mixer.refused = False
            source = next((s for s, n in layer.budget_sources.most_common() if n > 0), None)
        else:
            source = mixer.pick_source(layer.limit, rolling, ahead, admits_now)
        if source is None or (layer.budget is not None and layer.budget <= 0):
            # refused groups: counted on the first policy, as the curator's skips are
            buffers.counts[first]["admission_refused"] += mixer.refused
            return
        proposals += 1
        idx = mixer.next_prompt(source)
        payload = layer._train[idx]
        if not layer.curator.accept(prompt_key(idx), payload):
            buffers.counts[first]["curator_skipped"] += 1
            continue
        if layer.budget is not None:
            layer.budget -= 1
            if layer.budget_sources is not None:
                layer.budget_sources[source] -= 1
        grp = buffers.open_group(prompt_key(idx), source)
        mixer.groups_created[source] += 1
        for tid in grp.task_ids:
            layer.leases.add(RolloutTask(task_id=tid, group_id=grp.group_id, policies=tuple(layer.policy_names),
                                         workflow=layer.wcfg.workflow, prompt=payload, kind="train"))


def iteration_sources(layer: Any, groups: int) -> Counter:
    """The sources of ``groups`` more groups of a gated data layer with several sources: each
    goes to the source the first policy's next batch lacks most (its quota less what is
    buffered, in rollout or already allowed), so an iteration rolls out what its batch takes."""
    first, mixer, buffers = layer.policy_names[0], layer.mixer, layer.buffers
    gs = mixer.group_size
    quota, _ = mixer.quotas(first, layer.cfg.batch_size)
    avail = buffers.drop_stale_by_source(first, layer.versions[first], mixer.weights)
    rolling = buffers.rolling_by_source()
    lack = {s: quota[s] - avail[s] - gs * (rolling[s] + layer.budget_sources[s]) for s in quota}
    out: Counter = Counter()
    for _ in range(groups):
        s = max(lack, key=lack.__getitem__)  # config order breaks ties
        out[s] += 1
        lack[s] -= gs
    return out


def _rules_took(layer: Any, policy: str) -> str:
    """`rules_took` of ``layer``'s counts, for ``policy``'s batch."""
    first, counts = layer.policy_names[0], layer.buffers.counts
    return rules_took(counts[first]["curator_skipped"], sum(layer.mixer.groups_created.values()),
                      counts[policy]["filtered"], counts[policy]["sequences_ingested"],
                      layer.cfg.curator.type, layer.cfg.group_filter.type)


def rules_took(skipped: int, made: int, filtered: int, ingested: int, curator: str, group_filter: str) -> str:
    """A clause naming the curator and the group filter when they took most of what could have
    made a batch: as many prompts skipped as groups made, or half the sequences dropped."""
    parts = []
    if skipped and skipped >= made:
        parts.append(f"the curator (dataflow.curator: {curator}) skipped {skipped} prompts against {made} groups made")
    if filtered and 2 * filtered >= ingested:
        parts.append(f"the group filter (dataflow.group_filter: {group_filter}) dropped {filtered} of "
                     f"{ingested} sequences")
    if not parts:
        return ""
    return "; " + " and ".join(parts) + ": if they leave too little to train on, loosen them (e.g. a curator's " \
        "explore, or group_filter keep_all)"


def no_batch_reason(layer: Any, policy: str, version: int, timeout: float, avail: Mapping[str, int],
                    quota: Mapping[str, int], need: int) -> str:
    """Why ``next_batch`` found no batch in time: what is buffered, short, pending, leased, and
    whether admission is refusing new groups (then the nodes' weights are what to check)."""
    short = [s for s, q in quota.items() if avail[s] < q]
    sources = (f" (short: {', '.join(f'source {s!r} {avail[s]}/{quota[s]}' for s in short)})"
               if layer.mixer.mixing and short else "")
    held_back = ""  # what holds back a batch whose sequences are there
    behind = {p: v for p, v in layer.versions.items() if v < version}
    if layer.cfg.lockstep and behind:
        held_back = ("; waiting for dataflow.lockstep: " + ", ".join(f"{p} at v{v}" for p, v in behind.items())
                     + f" (below v{version}): is its trainer running?")
    elif not layer.ledger.events["leased"]:  # nothing can come before a node leases (an eval round neither)
        held_back = ("; no RaaS node has leased a task yet: do the rollout partitions have nodes, and did their "
                     "workers start (`astraflow status`, their logs under jobs/)?")
    elif not layer.evals.initial_done():
        held_back = ("; waiting for the first held-out evaluation round to finish (the RaaS nodes run its "
                     "tasks first; workload.eval.every: 0 turns evaluation off)")
    held_back += _rules_took(layer, policy)
    return (f"no batch for {policy} v{version} within {timeout:g}s: "
            f"{sum(avail.values())}/{need} sequences buffered{sources}, "
            f"{len(layer.leases.pending)} tasks pending, {len(layer.leases.held)} leased" + held_back
            + ("; admission refuses new groups that could not be trained on: do the RaaS "
               "nodes load new weight versions (their logs, rollout.weight_poll_seconds)?"
               if layer.mixer.refused else ""))
