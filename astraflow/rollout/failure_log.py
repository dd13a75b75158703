"""How a RaaS node logs its failed episodes without flooding its log.

A reward or tool that fails on a share of the tasks would write a line per failed episode, and
the workers' logs (``jobs/*.log``) are never rotated. So the first failure of each reason (the
exception type and where it was raised; the first line of its message where it has no traceback:
an error that names a task's value is still one bug) is logged with its traceback, and the later
ones are counted: one line per reason at most every ``every_s`` seconds says how many failed
with it since the last line about it. The node says what is still counted when it stops
(``flush``), and on each turn of its loop says what is due (``flush(due_only=True)``), so a
reason that stops failing is not left unsaid until then.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable

log = logging.getLogger("astraflow.rollout")

#: distinct failure reasons a node logs with their tracebacks and counts apart; reasons that
#: differ per task stop there, and the rest are counted together per exception type
MAX_REASONS = 100
#: seconds between two lines about the same failure reason
EVERY_S = 60.0

#: a reason key: (exception type, where it was raised or the first line of its message; None for a
#: type's other reasons)
Reason = tuple[str, str | None]


def reason_of(err: BaseException) -> Reason:
    """``err``'s reason: its type and the innermost frame of its traceback (``file:line``), or
    the first line of its message when it has no traceback."""
    tb = err.__traceback__
    if tb is None:
        return type(err).__name__, str(err).partition("\n")[0]
    while tb.tb_next is not None:
        tb = tb.tb_next
    return type(err).__name__, f"raised at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"


class FailureLog:
    """The failed-episode lines of one node (``node``: its name). ``clock`` gives the time in
    seconds (monotonic; a test passes its own)."""

    def __init__(self, node: str, *, every_s: float = EVERY_S, clock: Callable[[], float] = time.monotonic,
                 max_reasons: int = MAX_REASONS):
        self.node = node
        self.every_s, self.clock, self.max_reasons = every_s, clock, max_reasons
        #: per reason: when the last line about it was written
        self._said_at: dict[Reason, float] = {}
        #: per reason: failures since the last line about it
        self._counts: collections.Counter = collections.Counter()
        #: reasons logged with a traceback (at most ``max_reasons``)
        self._traced = 0

    def failed(self, task_id: str, err: BaseException) -> None:
        """Episode ``task_id`` failed with ``err``: logged with its traceback if its reason is
        new, else counted (and the count said if its last line is ``every_s`` old)."""
        kind, now = type(err).__name__, self.clock()
        reason = reason_of(err)
        if reason not in self._said_at:
            if self._traced < self.max_reasons:
                self._traced += 1
                self._said_at[reason] = now
                log.warning("episode %s failed: %s: %s", task_id, kind, err, exc_info=err)
                return
            reason = (kind, None)
            self._said_at.setdefault(reason, now)
        self._counts[reason] += 1
        if now - self._said_at[reason] >= self.every_s:
            self._say(reason, now)

    def flush(self, *, due_only: bool = False) -> None:
        """Say the counts not said yet: all of them (the node stops), or with ``due_only`` those
        whose reason's last line is ``every_s`` old."""
        now = self.clock()
        for reason in [r for r in self._counts if not due_only or now - self._said_at[r] >= self.every_s]:
            self._say(reason, now)

    def _say(self, reason: Reason, now: float) -> None:
        n = self._counts.pop(reason)
        kind, first = reason
        what = (f"{kind} (reasons past the first {self.max_reasons})" if first is None
                else f"{kind} {first}" if first.startswith("raised at ") else f"{kind}: {first}" if first else kind)
        log.warning("node %s: %d more episode%s failed in the last %.1f s: %s", self.node, n,
                    "" if n == 1 else "s", now - self._said_at[reason], what)
        self._said_at[reason] = now
