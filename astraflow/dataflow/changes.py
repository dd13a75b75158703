"""What the data layer's durable record holds, entry by entry (``changelog.py`` writes it).

The state that grows with the work in flight lives in keyed containers, each saved as one
entry per key, so that a record holds only the entries changed since the previous one:

* ``task``: task id -> ``(RolloutTask or None, TaskRecord, TrajectoryRef or None)``: the
  ledger's open task, until it completes its task (queues and leases are derived from the
  records on restore), and once it completed in a group still in rollout, its result;
* ``group``: group id -> the ``RolloutGroup`` in rollout (its results are its tasks' entries:
  a completion rewrites one task's entry, not the whole group);
* ``node``: node -> what is kept of it (``leased``, ``completed``, ``draining``, ``gone``);
* ``route``: task id -> ``(None, consumed, drop reason)`` of a task some policy consumed or
  dropped while another's buffer still holds it (the items not settled are counted from the
  buffers on restore: a task with one policy never needs the entry);
* ``ready``: ``(policy, ingest_seq)`` -> a buffered ``ReadyGroup``;
* ``serving``: ``(policy, version)`` -> the items of a batch served and not committed;
* ``round`` / ``result``: evaluation rounds not yet written by version (a written round's entry is
  removed: its record and version live on in ``result``), finished round records by position;
* ``order``: source -> ``(epoch, prompt order)`` as written when its epoch began or prompts were
  put back (otherwise it only shrinks from its end: each record holds its length), ``rng``: the
  random stream;
* ``staleness``: node -> how stale the sequences it generated were when a trainer consumed them
  (a Counter), written when a commit consumes some of them (the table grows with the nodes).

The rooms mark what they change (``Ledger.changed``, ``Leases.changed_nodes``,
``Buffers.changed``); a group changes only when one of its tasks is created or ends
(``Ledger.changed_group``) or it is ingested; evaluations are compared by counters, prompt
orders by epoch, and the random stream is written with every shuffle and every batch served
(what draws from it). Everything else (versions, the rules' state, lengths of the prompt orders, counters) is
small and saved whole in every record (``small``).
``assemble`` turns entries and small fields back into the form ``durable.restore`` loads,
which ``state_of`` also gives of a live layer.
"""

from __future__ import annotations

import bisect
import re
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Iterator

from astraflow.dataflow import record as rec

if TYPE_CHECKING:
    from astraflow.dataflow.layer import DataLayer

#: what a base written now is; a base of an earlier one of ``READABLE`` is read too (its task
#: entries have no result, its groups hold theirs, its routes count the items not settled). A kind
#: added later (``staleness``) keeps the format: a base without its entries restores it empty, and
#: an earlier AstraFlow reads a base with them (it leaves the kind out)
FORMAT = 3
READABLE = frozenset({2, 3})
KINDS = ("task", "group", "node", "route", "ready", "serving", "round", "result", "order", "rng", "staleness")
NODE_FIELDS = ("leased", "completed", "draining", "gone")
SMALL_BUFFER_FIELDS = ("group_seq", "groups_ingested", "counts", "staleness_hist", "wait_s", "last_batch",
                       "_ingest_seq", "served_replays")


def group_of(task_id: str) -> str:
    """The group of a task (ids are ``<group>/<index>``, ``Buffers.open_group``)."""
    return task_id.rpartition("/")[0]


def entry(dl: DataLayer, kind: str, key: Any) -> Any:
    """The current value of one entry of ``dl`` (None: there is none)."""
    if kind == "task":
        rec = dl.ledger.live.get(key)
        if rec is None:
            return None
        grp = dl.buffers.rolling.get(group_of(key)) if rec.state == "completed" else None
        return dl.leases.tasks.get(key), rec, None if grp is None else grp.results.get(key)
    if kind == "group":
        return dl.buffers.rolling.get(key)
    if kind == "node":
        info = dl.leases.nodes.get(key)
        kept = {f: info[f] for f in NODE_FIELDS if f in info} if info is not None else None
        return kept or None
    bf = dl.buffers
    if kind == "route":
        consumed, reason = key in bf.task_consumed, bf.task_drop_reason.get(key)
        return (None, consumed, reason) if consumed or reason is not None else None
    if kind == "ready":
        policy, seq = key
        buf = bf.ready.get(policy, [])
        i = bisect.bisect_left(buf, seq, key=lambda g: g.ingest_seq)  # a buffer is in ingest order
        return buf[i] if i < len(buf) and buf[i].ingest_seq == seq else None
    if kind == "serving":
        policy, version = key
        return bf.serving.get(policy, {}).get(version)
    if kind == "round":
        return dl.evals.rounds.get(key)
    if kind == "result":
        return dl.evals.results[key] if key < len(dl.evals.results) else None
    if kind == "order":
        return dl.mixer.epoch[key], list(dl.mixer.order[key])
    if kind == "rng":
        version, internal, gauss = dl.mixer.rng.getstate()
        return [version, list(internal), gauss]
    if kind == "staleness":
        return bf.staleness_by_node.get(key) or None
    raise ValueError(kind)


def all_keys(dl: DataLayer) -> Iterator[tuple[str, Any]]:
    """Every entry's ``(kind, key)`` (a whole record: the base a change log starts from)."""
    yield from (("task", t) for t in dl.ledger.live)
    yield from (("group", g) for g in dl.buffers.rolling)
    yield from (("node", n) for n in dl.leases.nodes)
    bf = dl.buffers
    yield from (("route", t) for t in {*bf.task_consumed, *bf.task_drop_reason})
    yield from (("ready", (p, g.ingest_seq)) for p, buf in bf.ready.items() for g in buf)
    yield from (("serving", (p, v)) for p, served in bf.serving.items() for v in served)
    yield from (("round", v) for v in dl.evals.rounds)
    yield from (("result", i) for i in range(len(dl.evals.results)))
    yield from (("order", s) for s in dl.mixer.order)
    yield ("rng", "mixer")
    yield from (("staleness", n) for n in bf.staleness_by_node)


class Marks:
    """The keys changed since the last record: taken from the rooms' marks, plus the groups of
    the tasks that moved and the evaluation rounds whose counters moved."""

    def __init__(self, dl: DataLayer):
        self.dl = dl
        dl.ledger.changed, dl.ledger.changed_group = set(), set()
        dl.leases.changed_nodes, dl.buffers.changed = set(), set()
        self._open_rounds = set(dl.evals.rounds)  # a round is held until it is written
        self._evals = self._eval_counters()
        self._results = len(dl.evals.results)
        self._epochs = dict(dl.mixer.epoch)
        self._retry: set[tuple[str, Any]] = set()

    def _eval_counters(self) -> tuple:
        ev, rounds = self.dl.ledger.events, self.dl.evals.rounds
        # the open rounds themselves (a few): one started as another is forgotten changes no count;
        # those leased (a round's first lease changes no count either)
        leased = tuple(v for v, r in rounds.items() if getattr(r, "leased_at", None) is not None)
        return tuple(rounds), leased, len(self.dl.evals.results), ev["evaluated"], ev["failed"]

    def take(self) -> set[tuple[str, Any]]:
        """The changed ``(kind, key)`` pairs; the marks start afresh."""
        dl = self.dl
        lg = dl.ledger
        tasks, grouped, nodes, buffered = lg.changed, lg.changed_group, dl.leases.changed_nodes, dl.buffers.changed
        lg.changed, lg.changed_group, dl.leases.changed_nodes, dl.buffers.changed = set(), set(), set(), set()
        out, self._retry = self._retry, set()
        out.update(("task", t) for t in tasks)
        out.update(("group", group_of(t)) for t in grouped)  # a lease or a completion leaves its group as it was
        out.update(("node", n) for n in nodes)
        out.update(k if len(k) == 2 else (k[0], (k[1], k[2])) for k in buffered)
        counters = self._eval_counters()
        if counters != self._evals:
            opened = set(dl.evals.rounds)
            out.update(("round", v) for v in opened | self._open_rounds)
            out.update(("result", i) for i in range(self._results, len(dl.evals.results)))
            self._evals, self._open_rounds, self._results = counters, opened, len(dl.evals.results)
        epochs = dl.mixer.epoch
        if epochs != self._epochs:
            out.update(("order", s) for s, e in epochs.items() if self._epochs.get(s) != e)
            self._epochs = dict(epochs)
        out.update(("order", s) for s in dl.mixer.rewritten)  # written whole: it grew
        dl.mixer.rewritten = set()
        # the random stream moves only when an order is shuffled or a batch samples replays
        if any(k[0] == "order" or k[0] == "serving" for k in out):
            out.add(("rng", "mixer"))
        return out

    def give_back(self, keys: set[tuple[str, Any]]) -> None:
        """A record that could not be written: its keys are taken again next time."""
        self._retry |= keys


def small(dl: DataLayer, lengths: dict[str, int]) -> dict[str, Any]:
    """What is saved whole in every record."""
    ledger, buffers = dl.ledger, dl.buffers
    core = rec.snapshot(versions=dl.versions, cfg=dl.cfg, rules=dl._rules(), mixer=dl.mixer,
                        group_seq=dl.buffers.group_seq, orders=False)  # orders and stream: entries of their own
    return {
        "saved_at": time.time(),
        "lengths": lengths,
        "core": core,
        "order_len": {s: len(o) for s, o in dl.mixer.order.items()},
        "policies": list(dl.policy_names),
        "layer": {"started": dl._started, "finished": dl.finished, "budget": dl.budget,
                  "budget_sources": dict(dl.budget_sources) if dl.budget_sources is not None else None,
                  "trainer_restarts": dl.trainer_restarts, "generated": dl.generated},
        "ledger": {"events": ledger.events, "dropped_by_reason": ledger.dropped_by_reason,
                   "failed_by_reason": ledger.failed_by_reason, "state_counts": ledger.state_counts,
                   "requeued_by_reason": ledger.requeued_by_reason},
        "buffers": {f: getattr(buffers, f) for f in SMALL_BUFFER_FIELDS},
        "mixer": {"consumed": dl.mixer.consumed, "groups_created": dl.mixer.groups_created},
    }


def _natural(task_id: str) -> list:
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", task_id)]


def assemble(fingerprint: str, small_fields: dict[str, Any], entries: dict[str, dict]) -> dict[str, Any]:
    """The saved state in the form ``durable.restore`` loads. Tasks waiting to be leased are
    queued in their kind's queue, those handed back first, then in creation order."""
    sm = small_fields
    tasks = {t: value[:2] for t, value in entries.get("task", {}).items()}
    rolling = dict(entries.get("group", {}))
    for t, value in entries.get("task", {}).items():  # results live with their tasks (earlier: in the group)
        grp = rolling.get(group_of(t)) if len(value) > 2 and value[2] is not None else None
        if grp is not None:
            grp.results[t] = value[2]
    waiting = sorted((t for t, (_, rec) in tasks.items() if rec.state == "pending"),
                     key=lambda t: (tasks[t][1].attempt == 0, _natural(t)))
    routes = entries.get("route", {})
    policies = sm["policies"]
    ready: dict[str, list] = {p: [] for p in policies}
    for (p, _), grp in sorted(entries.get("ready", {}).items(), key=lambda kv: kv[0][1]):
        ready[p].append(grp)
    serving: dict[str, dict] = {p: {} for p in policies}
    for (p, v), items in sorted(entries.get("serving", {}).items(), key=lambda kv: kv[0][1]):
        serving[p][v] = items
    # every item not yet settled sits in a buffer or a served batch: the count per task is derived
    routed_left: Counter = Counter(it.task_id for groups in ready.values() for grp in groups for it in grp.items)
    routed_left.update(it.task_id for by_version in serving.values() for items in by_version.values() for it in items)
    orders = entries.get("order", {})
    core = {**sm["core"], "order": {s: orders[s][1][:n] for s, n in sm["order_len"].items()},
            "rng_state": entries["rng"]["mixer"]}
    return {
        "format": FORMAT, "fingerprint": fingerprint, "saved_at": sm["saved_at"], "lengths": sm["lengths"],
        "core": core, "layer": sm["layer"],
        "leases": {"tasks": {t: task for t, (task, _) in tasks.items() if task is not None},
                   "pending": [t for t in waiting if tasks[t][0].kind != "eval"],
                   "eval_pending": [t for t in waiting if tasks[t][0].kind == "eval"],
                   "held": {t: rec.node for t, (_, rec) in tasks.items() if rec.state == "leased"},
                   "nodes": dict(entries.get("node", {}))},
        "ledger": {"live": {t: rec for t, (_, rec) in tasks.items()}, **sm["ledger"]},
        "buffers": {"rolling": rolling, "ready": ready, "serving": serving, "routed_left": dict(routed_left),
                    "task_consumed": {t for t, r in routes.items() if r[1]},
                    "task_drop_reason": {t: r[2] for t, r in routes.items() if r[2] is not None},
                    "staleness_by_node": dict(entries.get("staleness", {})), **sm["buffers"]},
        "mixer": sm["mixer"],
        "evals": {"rounds": dict(sorted(entries.get("round", {}).items())),
                  "results": [r for _, r in sorted(entries.get("result", {}).items())]},
    }


def state_of(dl: DataLayer, fingerprint: str, lengths: dict[str, int]) -> dict[str, Any]:
    """The state of a live ``dl`` in ``assemble``'s form: what a restore of its record gives."""
    entries: dict[str, dict] = {k: {} for k in KINDS}
    for kind, key in all_keys(dl):
        value = entry(dl, kind, key)
        if value is not None:
            entries[kind][key] = value
    return assemble(fingerprint, small(dl, lengths), entries)
