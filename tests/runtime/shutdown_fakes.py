"""What the stop path (``Shutdown._shutdown``) calls on a data layer, answered at once: the
tests of the way out use these instead of a cluster where the call itself is not the point."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

#: the ledger a finished data layer answers with unless told another
LEDGER = {"tasks": 8, "open": 0, "dropped_by_reason": {}}


def done(value: Any) -> Future:
    """A future already answered with ``value`` (an actor call that returned)."""
    f: Future = Future()
    f.set_result(value)
    return f


class FakeDataLayer:
    """A live data layer: ``finish`` answers ``ledger`` (and records what it was asked),
    ``state`` its evaluations and ``ledger``."""

    def __init__(self, ledger: dict[str, Any] | None = None, with_ledger_in_state: bool = False):
        self.ledger = LEDGER if ledger is None else ledger
        self.with_ledger_in_state = with_ledger_in_state
        self.finished_with: list[bool] = []

    def finish(self, completed: bool = True) -> Future:
        self.finished_with.append(completed)
        return done(self.ledger)

    def state(self) -> Future:
        return done({"eval": [], **({"ledger": self.ledger} if self.with_ledger_in_state else {})})

    def close(self) -> Future:
        return done(None)
