"""The task ledger: every leased task ends exactly once.

Invariant 1 of the design lives here. A task moves ``pending -> leased -> completed`` (possibly
``leased -> pending`` again when a lease expires or fails and attempts remain) and ends exactly
once as one of ``consumed`` (a trainer trained on its sequences and committed that version),
``dropped`` (with a reason: stale, zero_advantage, group_incomplete, run_ended,
served_not_trained: fetched by a trainer that stopped or asked again before committing),
``failed`` (with a reason) or ``evaluated`` (an evaluation task whose result was recorded).
Ending a task twice is a bug and asserts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

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

    def _move(self, rec: TaskRecord, new: str) -> None:
        self.state_counts[rec.state] -= 1
        self.state_counts[new] += 1
        rec.state = new

    def add(self, task_id: str) -> None:
        assert task_id not in self.tasks, f"task {task_id} created twice"
        self.tasks[task_id] = TaskRecord()
        self.state_counts["pending"] += 1
        self.events["created"] += 1

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
            "tasks": len(self.tasks),
            "states": dict(states),
            "events": dict(self.events),
            "dropped_by_reason": dict(self.dropped_by_reason),
            "failed_by_reason": dict(self.failed_by_reason),
            "open": self.open_tasks(),
        }
