"""Source mixing: which source's prompt is rolled out next, and how a batch is shared out.

Every prompt carries its source (``payload["source"]``, the ``mix`` workload); a single-source
workload is one source ``""`` of weight 1 and everything below reduces to the single-source
rules. This room owns each source's shuffled prompt order, the rollout-ahead shares and the
batch-time mixing credit; the data layer asks it and applies the answers.

* *before rollout*: each source has its own shuffled prompt order and its own rollout-ahead
  bound (its weighted share of the limit, raised to what a waiting batch still lacks of it);
  the next group goes to the source furthest below its weighted share of the groups ahead, so
  a source whose groups are filtered more often gets more rollouts, and a source with a full
  buffer never blocks a starved one.
* *at batch time*: a batch's groups are apportioned to sources by weight (largest credit
  first, the fractional credit carried across batches, so long-run proportions are exact);
  within a source the configured ordering picks groups. A batch waits until every source has
  its quota; the credit is saved with the rest of the state.

Named asynchronous overlap, *rollout ahead of training*: groups in rollout plus the groups
buffered for the hungriest policy stay below ``limit = groups_per_batch + prefetch_groups``
(``pick_source`` returns None at the bound), which bounds staleness and wasted rollouts
without coupling independent policies: a stalled trainer's growing buffer does not starve the
others (it is capped instead, see ``Buffers.cap``).
"""

from __future__ import annotations

import logging
import math
import random
from collections import Counter
from typing import Any, Callable

from astraflow.workloads.mix import SOURCE_KEY


def prompt_key(index: int) -> str:
    """The key of training prompt number ``index`` (a group's ``prompt_key``, the curator's)."""
    return f"p{index}"


def prompt_index(key: str) -> int | None:
    """The training prompt a ``prompt_key`` names; None for a key of another kind."""
    return int(key[1:]) if key[:1] == "p" and key[1:].isdigit() else None


log = logging.getLogger("astraflow.dataflow")


def empty_train_split(workload: str, params: dict[str, Any] | None) -> str:
    """The error for a workload whose train split holds no prompt."""
    return (f"workload {workload!r} has no training prompts (params {dict(params or {})}): give its train "
            "split data (e.g. workload.params.num_train > 0, or a dataset file with rows)")


class Mixer:
    """Per-source prompt orders, rollout-ahead shares and batch quotas."""

    def __init__(self, workload: str, weights: dict[str, float], train: list[dict[str, Any]],
                 policies: list[str], group_size: int, rng: random.Random):
        #: source name -> weight; one source "" of weight 1 unless the workload is a mixture
        self.weights = dict(weights)
        self.mixing = set(self.weights) != {""}
        self.group_size = group_size
        #: shuffles the prompt orders (shared with replay sampling: one stream, saved with the run)
        self.rng = rng
        #: source -> indices into the training prompts of its prompts
        self.by_source: dict[str, list[int]] = {s: [] for s in self.weights}
        for i, payload in enumerate(train):
            src = self.source_of(payload)
            if src not in self.by_source:
                raise ValueError(f"workload {workload!r}: a payload names source {src!r}, "
                                 f"not one of its source_weights() {sorted(self.weights)}")
            self.by_source[src].append(i)
        empty = [s for s, idx in self.by_source.items() if not idx]
        if empty and train:
            raise ValueError(f"workload {workload!r}: sources {empty} have no training prompts; "
                             "give them data or remove them")
        #: per source: the rest of the current epoch's shuffled prompt order, and epochs started
        self.order: dict[str, list[int]] = {s: [] for s in self.weights}
        self.epoch: dict[str, int] = {s: 0 for s in self.weights}
        #: batch-time mixing credit, per policy and source, in groups (sums to 0 per policy)
        self.credit: dict[str, dict[str, float]] = {p: {s: 0.0 for s in self.weights} for p in policies}
        #: policy -> source -> sequences a waiting batch still lacks (lets a source exceed its bound)
        self.short: dict[str, dict[str, int]] = {}
        #: policy -> source -> sequences of the source in the batch its trainer waits for
        self.wanted: dict[str, dict[str, int]] = {}
        self.consumed: dict[str, Counter] = {p: Counter() for p in policies}
        self.groups_created: Counter = Counter()
        #: the last ``pick_source`` found nothing because admission refused a source
        self.refused = False
        #: sources whose order was changed otherwise than by taking from its end (``put_back``):
        #: the durable record writes them whole (``changes``)
        self.rewritten: set[str] = set()

    def source_of(self, payload: dict[str, Any]) -> str:
        return str(payload.get(SOURCE_KEY, "")) if self.mixing else ""

    def next_prompt(self, source: str = "") -> int:
        """Index of the next training prompt of ``source`` (a new shuffled epoch when its
        order runs out)."""
        order = self.order[source]
        if not order:
            order.extend(self.by_source[source])
            self.rng.shuffle(order)
            self.epoch[source] += 1
        return order.pop()

    def put_back(self, source: str, indices: list[int]) -> None:
        """Prompts of groups a stopped run cut short, in the order they were taken: taken again
        first (a prompt still to come later in the current order moves up, never twice)."""
        order = self.order[source]
        for idx in reversed(indices):  # the order is taken from its end: the first goes last
            if idx in order:
                order.remove(idx)
            order.append(idx)
        self.rewritten.add(source)

    def pick_source(self, limit: int, rolling: Counter, buffered: dict[str, int],
                    admits: Callable[..., bool] | None = None) -> str | None:
        """The source of the next group, or ``None`` when every source is at its bound.

        ``rolling``: groups in rollout per source; ``buffered``: groups the hungriest policy
        has buffered per source. A source's bound is its weighted share of ``limit`` (rounded
        up; all of it for a single source). A source may exceed it while a waiting batch lacks
        more of its sequences than its groups in rollout will bring (otherwise a buffer holding
        partial groups could wait forever). Among the sources below their bound, the one whose
        groups ahead, plus the new one, are the smallest multiple of its weight goes next:
        groups ahead follow the weights, so a source whose groups are filtered (and leave the
        count) is refilled more often. ``admits(source, share, rolling, waiting)`` (admission
        by version; ``waiting``: policy -> the source's quota in its waiting batch, for the
        batches the source starves) may refuse any source, a starved one too: what it would
        roll out could not be trained on (a waiting batch fills once the nodes hold fresher
        weights); ``refused`` says whether a refusal left the answer None."""
        total_w = sum(self.weights.values())
        best, best_key = None, math.inf
        self.refused = False
        for s, w in self.weights.items():
            ahead = rolling[s] + buffered[s]
            bound = limit if len(self.weights) == 1 else max(1, math.ceil(limit * w / total_w - 1e-9))
            in_rollout = self.group_size * rolling[s]
            waiting = {p: self.wanted.get(p, {}).get(s, 0) for p, short in self.short.items()
                       if short.get(s, 0) > in_rollout}
            if ahead >= bound and not waiting:
                continue
            if admits is not None and not admits(s, w / total_w, rolling[s], waiting or None):
                self.refused = True
                continue
            key = (ahead + 1) / w
            if key < best_key:
                best, best_key = s, key
        if best is not None:
            self.refused = False
        return best

    def quotas(self, policy: str, need: int) -> tuple[dict[str, int], dict[str, float]]:
        """Sequences of each source in the next batch of ``policy`` and the mixing credit
        after it (committed with ``credit[policy] = ...`` only when the batch is served).

        The batch's ``need / group_size`` groups are apportioned by largest remainder with
        the remainder carried over: every source earns ``groups x weight / total`` credit
        per batch, each group goes to the source with the most credit (ties: config order)
        and costs it 1. Credits sum to 0 and stay bounded, so over many batches each source
        gets exactly its share, even when a batch's share is not a whole number of groups.
        A part of a group (``need`` not a multiple of the group size, with replay) goes the
        same way, costing its fraction of a group."""
        if len(self.weights) == 1:
            return {s: need for s in self.weights}, dict(self.credit[policy])
        gs = self.group_size
        total_w = sum(self.weights.values())
        credit = {s: c + need / gs * self.weights[s] / total_w for s, c in self.credit[policy].items()}
        quota = {s: 0 for s in self.weights}
        full, rest = divmod(need, gs)
        for n, cost in [(gs, 1.0)] * full + ([(rest, rest / gs)] if rest else []):
            s = max(credit, key=credit.__getitem__)  # first of the largest: config order breaks ties
            quota[s] += n
            credit[s] -= cost
        return quota, credit

    def consumed_by_source(self, policy: str) -> dict[str, int]:
        return {s: self.consumed[policy][s] for s in self.weights}

    def groups_by_source(self) -> dict[str, int]:
        return {s: self.groups_created[s] for s in self.weights}

    def state_dict(self, orders: bool = True) -> dict[str, Any]:
        """Prompt orders, epochs and mixing credit (the shared random stream is saved by the
        data layer's snapshot). ``orders`` False: without the prompt orders."""
        return {
            **({"order": {s: list(o) for s, o in self.order.items()}} if orders else {}),
            "epoch": dict(self.epoch),
            "mix_credit": {p: dict(c) for p, c in self.credit.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load ``state_dict()``; orders saved before sources existed are one source ``""``.
        Sources changed since the save: prompt orders and credit start fresh (a warning)."""
        order, epoch = state["order"], state["epoch"]
        if isinstance(order, list):  # saved before sources existed: one source ""
            order, epoch = {"": order}, {"": epoch}
        if set(order) == set(self.weights) and not all(set(o) <= set(self.by_source[s]) for s, o in order.items()):
            log.warning("the workload's training prompts changed since the run was saved (its orders name "
                        "prompts it no longer has): prompt orders start fresh")
        elif set(order) == set(self.weights):
            self.order = {s: list(o) for s, o in order.items()}
            self.epoch = {s: int(e) for s, e in epoch.items()}
        else:
            log.warning("workload sources changed from %s to %s since the run was saved: prompt orders "
                        "and mixing credit start fresh", sorted(order), sorted(self.weights))
        for p, c in state.get("mix_credit", {}).items():
            if p in self.credit and set(c) == set(self.credit[p]):
                self.credit[p] = {s: float(x) for s, x in c.items()}
