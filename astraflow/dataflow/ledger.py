"""The task ledger: every leased task ends exactly once.

Invariant 1 of the design lives here. A task moves ``pending -> leased -> completed`` (possibly
``leased -> pending`` again when a lease expires or fails and attempts remain, or when a lease
stock returns a task it never handed out) and ends exactly
once as one of ``consumed`` (a trainer trained on its sequences and committed that version),
``dropped`` (with a reason: stale, zero_advantage, group_incomplete, run_ended,
served_not_trained: fetched by a trainer that stopped before committing, at a run's end),
``failed`` (with a reason) or ``evaluated`` (an evaluation task whose result was recorded).
Ending a task twice is a bug and asserts.

``journal`` (when set) is told every creation and every end, in order: the data layer appends
them to ``ledger.jsonl`` (``durable.py``), the run's record that every task ended once.
``changed`` (when set) collects the ids of the tasks whose record moved, which the data layer's
change log writes (``changes.py``); ``changed_group`` those whose move also changed their group.

Memory stays flat however long a run is: an ended task keeps only its outcome, and only the
``remember`` most recent ones are kept (a late duplicate completion of an older one is still
refused and counted: what is not live cannot complete). The counters are never forgotten.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Callable

TERMINAL = ("consumed", "dropped", "failed", "evaluated")


@dataclass
class TaskRecord:
    state: str = "pending"  # pending | leased | completed | one of TERMINAL
    attempt: int = 0
    node: str | None = None
    reason: str | None = None


#: ended tasks whose outcome the ledger keeps (older ones are forgotten, their counts kept)
REMEMBER_ENDED = 100_000
#: distinct reasons counted by name per outcome (an error whose message carries its input would
#: otherwise add a key per task to every status and summary); later ones are counted together
MAX_REASONS = 32
#: the counter of the reasons past ``MAX_REASONS`` (a node logs each reason's first traceback)
OTHER_REASONS = "other reasons (see the RaaS nodes' logs)"
#: characters of a reason that name its counter
REASON_CHARS = 300


def count_reason(counter: Counter, reason: str | None) -> None:
    """Count ``reason`` (its first line, at most ``REASON_CHARS``) in ``counter``, under
    ``OTHER_REASONS`` once ``MAX_REASONS`` reasons are counted by name."""
    key = str(reason or "unknown").strip().split("\n", 1)[0][:REASON_CHARS] or "unknown"
    if key not in counter and len(counter) >= MAX_REASONS:
        key = OTHER_REASONS
    counter[key] += 1


class _AllTasks(Mapping):
    """The live tasks' records, then the remembered ended tasks' (rebuilt from their outcome)."""

    def __init__(self, ledger: "Ledger"):
        self._ledger = ledger

    def __getitem__(self, task_id: str) -> TaskRecord:
        rec = self._ledger.live.get(task_id)
        if rec is not None:
            return rec
        return TaskRecord(state=self._ledger.ended[task_id])

    def __iter__(self) -> Iterator[str]:
        yield from self._ledger.live
        yield from self._ledger.ended

    def __len__(self) -> int:
        return len(self._ledger.live) + len(self._ledger.ended)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._ledger.live or task_id in self._ledger.ended


@dataclass
class Ledger:
    #: ended tasks: id -> outcome, the ``remember`` most recent
    ended: OrderedDict = field(default_factory=OrderedDict)
    remember: int = REMEMBER_ENDED
    events: Counter = field(default_factory=Counter)
    dropped_by_reason: Counter = field(default_factory=Counter)
    failed_by_reason: Counter = field(default_factory=Counter)
    #: attempts given back to run again, by why (a node's failure report names its error)
    requeued_by_reason: Counter = field(default_factory=Counter)
    #: tasks per state, kept up to date on every transition (summaries are O(1))
    state_counts: Counter = field(default_factory=Counter)
    #: the tasks that have not ended (what a snapshot of the data layer saves)
    live: dict[str, TaskRecord] = field(default_factory=dict)
    #: told ``(task_id, "created" or an outcome, reason)`` on every creation and end
    journal: Callable[[str, str, str | None], None] | None = None
    #: the ids of tasks created, moved or ended since the change log last took them (None: not kept)
    changed: set[str] | None = None
    #: those of them created, completed or ended: only these moves change what their group holds
    #: (a lease or a requeue changes the task's own record); kept with ``changed``
    changed_group: set[str] | None = None

    @property
    def tasks(self) -> Mapping[str, TaskRecord]:
        """Every task the ledger knows: live ones, then the remembered ended ones."""
        return _AllTasks(self)

    def _touch(self, task_id: str, group: bool = True) -> None:
        if self.changed is not None:
            self.changed.add(task_id)
            if group:
                self.changed_group.add(task_id)  # type: ignore[union-attr]

    def _move(self, rec: TaskRecord, new: str) -> None:
        self.state_counts[rec.state] -= 1
        self.state_counts[new] += 1
        rec.state = new

    def add(self, task_id: str) -> None:
        assert task_id not in self.live and task_id not in self.ended, f"task {task_id} created twice"
        self.live[task_id] = TaskRecord()
        self._touch(task_id)
        self.state_counts["pending"] += 1
        self.events["created"] += 1
        if self.journal is not None:
            self.journal(task_id, "created", None)

    def lease(self, task_id: str, node: str) -> None:
        rec = self.live[task_id]
        assert rec.state == "pending", f"lease of {task_id} in state {rec.state}"
        self._touch(task_id, group=False)
        self._move(rec, "leased")
        rec.node = node
        self.events["leased"] += 1

    def requeue(self, task_id: str, why: str) -> None:
        self._unlease(task_id, "requeue").attempt += 1
        self.events["requeued"] += 1
        self.events[f"requeued_{why.split(':', 1)[0]}"] += 1  # by kind: a failure's message is not an event
        count_reason(self.requeued_by_reason, why)

    def moved(self, task_id: str, node: str) -> None:
        """A leased task changed hands (a worker's lease stock gave it to one of its nodes)."""
        self._touch(task_id, group=False)
        self.live[task_id].node = node

    def returned(self, task_id: str) -> None:
        """A leased task that never ran comes back as it was: no attempt is counted."""
        self._unlease(task_id, "return")
        self.events["returned"] += 1

    def _unlease(self, task_id: str, what: str) -> TaskRecord:
        rec = self.live[task_id]
        assert rec.state == "leased", f"{what} of {task_id} in state {rec.state}"
        self._touch(task_id, group=False)
        self._move(rec, "pending")
        rec.node = None
        return rec

    def complete(self, task_id: str) -> bool:
        """Record a completion; False for a duplicate or a completion of an ended task."""
        rec = self.live.get(task_id)
        if rec is None or rec.state not in ("leased", "pending"):
            self.events["duplicate_completions"] += 1
            return False
        self._touch(task_id, group=False)  # its result is written with its own entry
        self._move(rec, "completed")
        self.events["completed"] += 1
        return True

    def end(self, task_id: str, outcome: str, reason: str | None = None) -> None:
        assert outcome in TERMINAL, outcome
        rec = self.live.pop(task_id, None)
        assert rec is not None, f"task {task_id} ended twice ({self.ended.get(task_id, 'forgotten')}, then {outcome})"
        self._touch(task_id)
        self._move(rec, outcome)
        self.remember_end(task_id, outcome)
        if self.journal is not None:
            self.journal(task_id, outcome, reason)
        self.events[outcome] += 1
        if outcome == "dropped":
            count_reason(self.dropped_by_reason, reason)
        elif outcome == "failed":
            count_reason(self.failed_by_reason, reason)

    def remember_end(self, task_id: str, outcome: str) -> None:
        """Keep ``task_id``'s outcome, forgetting the oldest beyond ``remember``."""
        self.ended[task_id] = outcome
        while len(self.ended) > self.remember:
            self.ended.popitem(last=False)

    def state_of(self, task_id: str) -> str:
        rec = self.live.get(task_id)
        return rec.state if rec is not None else self.ended[task_id]

    def open_tasks(self) -> int:
        return sum(n for s, n in self.state_counts.items() if s not in TERMINAL)

    def summary(self) -> dict:
        states = {s: n for s, n in self.state_counts.items() if n}
        return {
            "tasks": self.events["created"],
            "states": dict(states),
            "events": dict(self.events),
            "dropped_by_reason": dict(self.dropped_by_reason),
            "failed_by_reason": dict(self.failed_by_reason),
            "requeued_by_reason": dict(self.requeued_by_reason),
            "open": self.open_tasks(),
        }
