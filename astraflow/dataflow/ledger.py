"""The task ledger: every leased task ends exactly once.

Invariant 1 of the design lives here. A task moves ``pending -> leased -> completed`` (possibly
``leased -> pending`` again when a lease expires or fails and attempts remain) and ends exactly
once as one of ``consumed`` (a trainer trained on its sequences and committed that version),
``dropped`` (with a reason: stale, zero_advantage, group_incomplete, run_ended,
served_not_trained: fetched by a trainer that stopped or asked again before committing),
``failed`` (with a reason) or ``evaluated`` (an evaluation task whose result was recorded).
Ending a task twice is a bug and asserts.

``journal`` (when set) is told every creation and every end, in order: the data layer appends
them to ``ledger.jsonl`` (``durable.py``), the run's record that every task ended once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

TERMINAL = ("consumed", "dropped", "failed", "evaluated")


@dataclass
class TaskRecord:
    state: str = "pending"  # pending | leased | completed | one of TERMINAL
    attempt: int = 0
    node: str | None = None
    reason: str | None = None


@dataclass
class Ledger:
    tasks: dict[str, TaskRecord] = field(default_factory=dict)
    events: Counter = field(default_factory=Counter)
    dropped_by_reason: Counter = field(default_factory=Counter)
    failed_by_reason: Counter = field(default_factory=Counter)
    #: tasks per state, kept up to date on every transition (summaries are O(1))
    state_counts: Counter = field(default_factory=Counter)
    #: the tasks that have not ended (what a snapshot of the data layer saves)
    live: dict[str, TaskRecord] = field(default_factory=dict)
    #: told ``(task_id, "created" or an outcome, reason)`` on every creation and end
    journal: Callable[[str, str, str | None], None] | None = None

    def _move(self, rec: TaskRecord, new: str) -> None:
        self.state_counts[rec.state] -= 1
        self.state_counts[new] += 1
        rec.state = new

    def add(self, task_id: str) -> None:
        assert task_id not in self.tasks, f"task {task_id} created twice"
        self.tasks[task_id] = self.live[task_id] = TaskRecord()
        self.state_counts["pending"] += 1
        self.events["created"] += 1
        if self.journal is not None:
            self.journal(task_id, "created", None)

    def lease(self, task_id: str, node: str) -> None:
        rec = self.tasks[task_id]
        assert rec.state == "pending", f"lease of {task_id} in state {rec.state}"
        self._move(rec, "leased")
        rec.node = node
        self.events["leased"] += 1

    def requeue(self, task_id: str, why: str) -> None:
        rec = self.tasks[task_id]
        assert rec.state == "leased", f"requeue of {task_id} in state {rec.state}"
        self._move(rec, "pending")
        rec.node = None
        rec.attempt += 1
        self.events["requeued"] += 1
        self.events[f"requeued_{why}"] += 1

    def complete(self, task_id: str) -> bool:
        """Record a completion; False for a duplicate or a completion of an ended task."""
        rec = self.tasks.get(task_id)
        if rec is None or rec.state not in ("leased", "pending"):
            self.events["duplicate_completions"] += 1
            return False
        self._move(rec, "completed")
        self.events["completed"] += 1
        return True

    def end(self, task_id: str, outcome: str, reason: str | None = None) -> None:
        assert outcome in TERMINAL, outcome
        rec = self.tasks[task_id]
        assert rec.state not in TERMINAL, f"task {task_id} ended twice ({rec.state}, then {outcome})"
        self._move(rec, outcome)
        rec.reason = reason
        self.live.pop(task_id, None)
        if self.journal is not None:
            self.journal(task_id, outcome, reason)
        self.events[outcome] += 1
        if outcome == "dropped":
            self.dropped_by_reason[reason or "unknown"] += 1
        elif outcome == "failed":
            self.failed_by_reason[reason or "unknown"] += 1

    def state_of(self, task_id: str) -> str:
        return self.tasks[task_id].state

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
            "open": self.open_tasks(),
        }
