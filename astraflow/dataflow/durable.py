"""Durability: the data layer's state outlives its worker and the run's head.

Nothing committed is lost and nothing is trained twice when the data layer's worker dies (it
is re-placed from this state, see ``runtime/restarts.py``) or the whole run does (the next
``astraflow run`` on the directory continues from it). Files in ``<run>/control/``:

* ``dataflow.snapshot`` and ``dataflow.changes.<n>``: everything the layer holds that is not
  rebuilt from the config: tasks and their leases, the ledger's open tasks and counters, groups
  in rollout with the trajectories completed so far, the buffers, batches served and not yet
  committed, evaluation rounds, counters (per node: the staleness of what was consumed of its
  sequences), and what ``dataflow_state.json`` holds (versions, rules, prompt orders, the
  random stream). A base and an append-only log of the entries that
  changed since (``changelog.py``; what an entry is: ``changes.py``). Before any call that
  changed the state returns, a record of its changes is written; calls that run at the same
  time share one record (a group commit), whose cost follows what changed, not how much the
  layer holds. A call's answer therefore never tells a node or a trainer something the next
  data layer will not know. Writes reach the kernel, which is enough when a process is killed;
  only the records at the end of a run and at a trainer's restart, and every base, are
  fsynced. After a machine loses power the log may end earlier than the weight store: the
  resume's ``trainer_restarted`` records the versions committed since, and the tasks leased
  since are leased again. Not saved: the replay pool (it refills from the next batches), node
  statistics (the next heartbeat brings them) and the order of waiting tasks (they are queued
  again handed-back first, then in creation order).
* ``ledger.jsonl``: one line per task created and per task ended (``{"t": id, "e": "created" |
  outcome, "r": reason}``): the run's record that every task ended once, across incarnations.

Every record holds how long ``ledger.jsonl`` and ``metrics.jsonl`` were when it was written. A
restore cuts both back to the lengths of the last record: lines written after it describe
changes the restored layer does not have, and are written again when the calls are retried.
A restored layer writes a new base of what it holds before it answers any call.

The files are pickles read back by ``storage.safe_pickle.AllowlistUnpickler`` with only the
data layer's record classes: a forged file cannot run code, it is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections import Counter, deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from astraflow.dataflow import changelog
from astraflow.dataflow import record as rec
from astraflow.dataflow.changelog import FORMAT, SNAPSHOT_GLOBALS, ChangeLog, UnusableSnapshot
from astraflow.dataflow.ledger import TERMINAL
from storage.trajectories import EntryRef

if TYPE_CHECKING:
    from astraflow.dataflow.layer import DataLayer
    from astraflow.workloads.config import WorkloadConfig

__all__ = ["FORMAT", "SNAPSHOT_GLOBALS", "Durability", "UnusableSnapshot", "load"]

log = logging.getLogger("astraflow.dataflow")

#: a string as ``json.dumps`` quotes it (ASCII, escaped)
_quoted = json.encoder.encode_basestring_ascii


def fingerprint_of(policies: list[str], workload: WorkloadConfig) -> str:
    """What the saved tasks, groups and buffers depend on: a resumed run whose config changed
    these restores what ``dataflow_state.json`` holds and the run's record so far, not its open
    tasks (they end as dropped, ``carry_over``)."""
    key = {"policies": list(policies), "group_size": workload.group_size, "workload": workload.name,
           "params": workload.params, "seed": workload.seed, "workflow": workload.workflow}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Journal(rec.AppendLog):
    """``ledger.jsonl``: appended on every creation and end, flushed before every snapshot."""

    def __init__(self, path: Path | None, on_error: Callable[[BaseException], None] | None = None):
        self.path = path
        super().__init__(path, buffering=1 << 16, on_error=on_error)

    def __call__(self, task_id: str, event: str, reason: str | None) -> None:
        if self._file is None:
            return
        if not isinstance(reason, (str, type(None))):
            line = json.dumps({"t": task_id, "e": event, "r": reason}) + "\n"
        else:  # the line ``json.dumps`` writes, without building a dict and an encoder per call
            line = f'{{"t": {_quoted(task_id)}, "e": {_quoted(event)}'
            line = line + "}\n" if reason is None else f'{line}, "r": {_quoted(reason)}}}\n'
        self._append(line)


def read_journal(path: Path) -> Iterator[dict[str, Any]]:
    """The lines of a ``ledger.jsonl``, one at a time (a last line cut short by a crash is
    skipped): a resume reads a days-long run's journal in the memory of one line."""
    if not path.exists():
        return
    with open(path, errors="replace") as f:
        for line in f:
            try:
                yield json.loads(line)
            except ValueError:
                continue


def cut_back(state: dict[str, Any], journal_path: Path | None, metrics_path: Path | None) -> None:
    """Cut ``ledger.jsonl`` and ``metrics.jsonl`` back to their lengths when ``state`` was
    taken (before they are opened for appending). One shorter than that lost records the state
    counts on (damaged, or not yet on disk at a power loss): the run goes on, with a warning."""
    for path, length in ((journal_path, state["lengths"]["journal"]), (metrics_path, state["lengths"]["metrics"])):
        if path is None:
            continue
        size = path.stat().st_size if path.exists() else 0
        if size > length:
            os.truncate(path, length)
        elif size < length:
            log.warning("%s holds %d bytes, fewer than the %d the saved state records: its last records are lost "
                        "(the file was damaged or cut short, or not on disk at a power loss); the run goes on from "
                        "the saved state, and those records stay missing from it", path, size, length)


class Durability:
    """The data layer's snapshot and journal (module docstring): built before the layer opens
    its files (a saved snapshot cuts them back first), attached and restored once it is built."""

    def __init__(self, snapshot_path: str | None, journal_path: str | None, metrics_path: str | None,
                 policies: list[str], workload: WorkloadConfig):
        self.fingerprint = fingerprint_of(policies, workload)
        self.snapshot_path = Path(snapshot_path) if snapshot_path else None
        self.journal_path = Path(journal_path) if journal_path else None
        #: the saved snapshot (None: none); ``UnusableSnapshot`` when it cannot be used
        self.saved = load(self.snapshot_path) if self.snapshot_path is not None else None
        if self.saved is not None:
            cut_back(self.saved, self.journal_path, Path(metrics_path) if metrics_path else None)
        self.log = ChangeLog(self.snapshot_path, self.fingerprint)
        # a line of the journal or of metrics.jsonl lost half way through a call: the state
        # that call left must never be committed (a re-placed data layer starts before it)
        self.journal = Journal(self.journal_path, on_error=self.log.fail)
        self._dl: DataLayer | None = None

    def lengths(self) -> dict[str, int]:
        """``metrics.jsonl`` and ``ledger.jsonl`` flushed to the kernel: their lengths."""
        return {"metrics": self._dl.metrics.flush(), "journal": self.journal.flush()}

    async def commit(self, sync: bool = False) -> None:
        """Return once every change made so far is in the log (``ChangeLog.commit``)."""
        await self.log.commit(sync)

    async def close(self) -> None:
        await self.log.close()
        self.journal.close()

    def restore(self, dl: DataLayer, keep_leases: bool) -> tuple[dict[str, Any] | None, dict[str, set[int]]]:
        """Attach to the built ``dl`` and load what was saved: the whole snapshot when it is of
        this configuration, else its ``core`` and what holds no task (``carry_over``: the saved
        open tasks end as dropped, ``config_changed``), or ``dataflow_state.json`` when there is
        no snapshot. Returns what was restored (None: nothing) and, per policy, the versions of
        batches served and not committed when ``keep_leases`` (the data layer was re-placed)."""
        self._dl = dl
        dl.ledger.journal = self.journal
        dl.metrics.on_error = self.log.fail
        saved = self.saved
        core = saved["core"] if saved is not None else (rec.load(dl._state_path) if dl._state_path else None)
        if core is not None:
            dl.buffers.group_seq = rec.restore(core, versions=dl.versions, cfg=dl.cfg, rules=dl._rules(),
                                               mixer=dl.mixer)
        in_doubt: dict[str, set[int]] = {p: set() for p in dl.policy_names}
        restored = None
        if saved is None or saved["fingerprint"] != self.fingerprint:
            # not restored: the ids the journal names stay taken (a new evaluation round or
            # group must not reuse one: a task is created and ended once); the saved group count
            # (``dataflow_state.json``, written at each step) may be behind the groups made since
            dl.buffers.group_seq = max(dl.buffers.group_seq, remember_ended(dl, self.journal_path))
        if saved is None:  # no snapshot (moved aside): the tasks the journal left open end here, once
            for tid in open_in_journal(self.journal_path):
                self.journal(tid, "dropped", "snapshot_lost")
                dl.ledger.remember_end(tid, "dropped")
        elif saved["fingerprint"] != self.fingerprint:  # the config changed what its tasks mean
            dropped = carry_over(dl, saved, self.journal)
            log.warning("the config changed what the saved tasks mean (policies, group size, workload or workflow): "
                        "%d open tasks of the previous run were dropped (config_changed) and are not reused; "
                        "the ledger's counts and finished evaluations carry over", dropped)
        else:
            restored = restore(dl, saved, self.journal_path, keep_leases)
            if keep_leases:
                in_doubt = {p: set(dl.buffers.serving[p]) for p in dl.policy_names}
        self.log.start(dl, self.lengths)
        return restored, in_doubt


# -- what is saved -----------------------------------------------------------------------------

_BUFFER_FIELDS = ("rolling", "group_seq", "groups_ingested", "ready", "serving", "routed_left", "task_consumed",
                  "task_drop_reason", "counts", "staleness_hist", "wait_s", "last_batch", "_ingest_seq")


def load(path: Path) -> dict[str, Any] | None:
    """The state saved at ``path`` (``changelog.load``; None when there is none);
    ``UnusableSnapshot`` when it cannot be read or refers to anything but the data layer's records."""
    return changelog.load(path)


def held_refs(state: dict[str, Any]) -> list[EntryRef]:
    """Every stored row the saved state's buffers still name (``load``'s result): the results of
    groups being rolled out, the buffered items and the batches served and not committed. A
    resume serves them to trainers, so their segments must still be in the trajectory store."""
    bf = state["buffers"]
    return list(refs_in(bf["rolling"], bf["ready"], bf["serving"]))


def refs_in(rolling: dict, ready: dict, serving: dict) -> Iterator[EntryRef]:
    """The stored rows named by groups being rolled out, buffered groups and served batches
    (``Buffers``' fields, live or saved)."""
    for grp in rolling.values():
        for res in grp.results.values():
            yield from (s.ref for s in res.sequences)
    for groups in ready.values():
        yield from (it.summary.ref for grp in groups for it in grp.items)
    for by_version in serving.values():
        yield from (it.summary.ref for items in by_version.values() for it in items)


def missing_rows(state: dict[str, Any], store: Any) -> dict[str, int]:
    """Per segment of ``store`` (a ``TrajectoryStore``), how many rows ``held_refs`` names that it
    does not hold (the segment deleted, or cut back): empty when a resume can serve them all."""
    present = set(store.segments())
    committed: dict[str, int] = {}
    missing: Counter = Counter()
    for ref in held_refs(state):
        if ref.segment not in committed:
            committed[ref.segment] = store.count(ref.segment) if ref.segment in present else 0
        if ref.index >= committed[ref.segment]:
            missing[ref.segment] += 1
    return dict(missing)


def open_in_journal(journal_path: Path | None) -> list[str]:
    """The tasks the journal at ``journal_path`` created and never ended, in creation order."""
    created: dict[str, None] = {}
    for line in read_journal(journal_path) if journal_path is not None else []:
        if line.get("e") == "created":
            created[line["t"]] = None
        elif line.get("e") in TERMINAL:
            created.pop(line["t"], None)
    return list(created)


_TRAIN_GROUP = re.compile(r"^g(\d+)/")


def remember_ended(dl: DataLayer, journal_path: Path | None) -> int:
    """The ledger of ``dl`` learns the tasks the journal at ``journal_path`` ended. Returns the
    highest train group number the journal names (0: none)."""
    highest = 0
    for line in read_journal(journal_path) if journal_path is not None else []:
        if line.get("e") in TERMINAL:
            dl.ledger.remember_end(line["t"], line["e"])
        found = _TRAIN_GROUP.match(str(line.get("t", "")))
        if found:
            highest = max(highest, int(found.group(1)))
    return highest


def run_start(layer: dict[str, Any], saved_at: float | None) -> float:
    """When a new incarnation's run started: the time between runs is not run time."""
    started = float(layer["started"])
    return time.time() - max(0.0, float(saved_at) - started) if saved_at else started


def carry_over(dl: DataLayer, state: dict[str, Any], journal: Callable[[str, str, str | None], None]) -> int:
    """A resume whose config changed what the saved tasks mean (``fingerprint_of``): they are not
    reused; each open task ends as dropped (``config_changed``, counted). What holds no task is the
    run's record so far and is kept: the ledger's counters, the finished evaluation rounds (a
    version already evaluated is not evaluated again), the run time, what was generated, the
    staleness per node of what was consumed and the trainers' restarts. The buffers' counts start
    afresh: admission estimates a group's yield from them, and a group of the new config may
    yield another number. Returns the open tasks dropped."""
    layer, lg, bf, ledger = state["layer"], state["ledger"], state["buffers"], dl.ledger
    ledger.events, ledger.dropped_by_reason = Counter(lg["events"]), Counter(lg["dropped_by_reason"])
    ledger.failed_by_reason, ledger.state_counts = Counter(lg["failed_by_reason"]), Counter(lg["state_counts"])
    ledger.requeued_by_reason = Counter(lg.get("requeued_by_reason") or {})  # absent from older states
    for tid, record in lg["live"].items():
        journal(tid, "dropped", "config_changed")
        ledger.remember_end(tid, "dropped")
        ledger.state_counts[record.state] -= 1
    dropped = len(lg["live"])
    if dropped:
        ledger.state_counts["dropped"] += dropped
        ledger.events["dropped"] += dropped
        ledger.dropped_by_reason["config_changed"] += dropped
    ledger.state_counts = +ledger.state_counts  # the open states are empty now
    # rounds whose tasks were just dropped are started afresh (under new ids) when asked for
    dl.evals.rounds = {v: r for v, r in state["evals"]["rounds"].items() if r.result is not None}
    dl.evals.results = list(state["evals"]["results"])
    dl.evals.write()  # a finished round held back behind one left out here
    dl._started = dl.evals.started = run_start(layer, state.get("saved_at"))
    dl.trainer_restarts = Counter(layer["trainer_restarts"])
    generated = layer["generated"]
    generated.episode_stats = {p: generated.episode_stats.get(p, (0, {})) for p in dl.policy_names}
    dl.generated = generated
    dl.buffers.staleness_by_node = {n: Counter(h) for n, h in bf.get("staleness_by_node", {}).items()}
    return dropped


def restore(dl: DataLayer, state: dict[str, Any], journal_path: Path | None, keep_leases: bool) -> dict[str, Any]:
    """Load ``state`` (``load``) into a freshly built ``dl`` (files already ``cut_back``;
    ``rec.restore`` of ``state["core"]`` done by the caller). ``keep_leases``: the nodes holding leases
    still run (the data layer alone was replaced): their leases stay, with a fresh deadline;
    otherwise (a new run incarnation) they go back to the queue, without counting an attempt.
    Returns what was restored, for the log."""
    layer, ls, lg, bf = state["layer"], state["leases"], state["ledger"], state["buffers"]
    dl._started = dl.evals.started = layer["started"] if keep_leases else run_start(layer, state.get("saved_at"))
    dl.budget = layer["budget"]
    if dl.budget_sources is not None:
        dl.budget_sources = Counter(layer.get("budget_sources") or {})
    dl.finished = all(v >= dl.max_steps for v in dl.versions.values())  # a resumed run may go further
    dl.trainer_restarts = Counter(layer["trainer_restarts"])
    dl.generated = layer["generated"]
    ledger = dl.ledger
    remember_ended(dl, journal_path)  # duplicate completions of ended tasks are recognised
    ledger.live = lg["live"]
    ledger.events, ledger.dropped_by_reason = lg["events"], lg["dropped_by_reason"]
    ledger.failed_by_reason, ledger.state_counts = lg["failed_by_reason"], lg["state_counts"]
    ledger.requeued_by_reason = Counter(lg.get("requeued_by_reason") or {})  # absent from older states
    leases = dl.leases
    leases.tasks = ls["tasks"]
    leases.pending, leases.eval_pending = deque(ls["pending"]), deque(ls["eval_pending"])
    # a new incarnation's nodes may reuse the names of the old ones: they start with a clean slate
    leases.nodes = {n: dict(i) for n, i in ls["nodes"].items()} if keep_leases else {}
    deadline = time.time() + leases.lease_seconds
    # a node's last call is not kept: every node's silence counts from now (one that does not
    # call again within a lease time is then taken as hung, as any other)
    for info in leases.nodes.values():
        info["last_seen"] = deadline - leases.lease_seconds
    released = 0
    for tid, node in ls["held"].items():
        if keep_leases:
            leases.hold(tid, node, deadline)
            continue
        released += 1
        rec = ledger.live[tid]
        ledger._move(rec, "pending")
        rec.node = None
        ledger.events["requeued_run_resumed"] += 1
        leases._queue(leases.tasks[tid].kind).appendleft(tid)
    for f in _BUFFER_FIELDS:
        setattr(dl.buffers, f, bf[f])
    for p, by_version in bf.get("served_replays", {}).items():  # absent from an earlier AstraFlow's records
        dl.buffers.served_replays.setdefault(p, {}).update(by_version)
    # absent from an earlier AstraFlow's records
    dl.buffers.staleness_by_node = {n: Counter(h) for n, h in bf.get("staleness_by_node", {}).items()}
    dl.mixer.consumed, dl.mixer.groups_created = state["mixer"]["consumed"], state["mixer"]["groups_created"]
    dl.evals.rounds, dl.evals.results = state["evals"]["rounds"], state["evals"]["results"]
    if not keep_leases:  # an open round's time between the runs is not time spent evaluating
        between = dl._started - float(layer["started"])
        for rnd in dl.evals.rounds.values():
            if rnd.result is None:
                rnd.started += between
                leased = getattr(rnd, "leased_at", None)  # absent from rounds an earlier AstraFlow saved
                rnd.leased_at = None if leased is None else leased + between
    # a round left open by an earlier run's end has no tasks left: it would hold back every later record
    open_evals = {int(t.min_version) for tid, t in leases.tasks.items() if t.kind == "eval" and tid in ledger.live}
    dl.evals.drop_unfinishable(lambda version: version in open_evals)
    return {"open_tasks": len(ledger.live), "leases_kept": len(leases.held), "leases_released": released,
            "groups_rolling": len(dl.buffers.rolling),
            "buffered": sum(len(g.items) for b in dl.buffers.ready.values() for g in b),
            "served_uncommitted": {p: sorted(s) for p, s in dl.buffers.serving.items() if s}}
