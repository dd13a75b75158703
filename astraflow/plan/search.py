"""The pool sizes at which the trainer stops waiting.

Rule: every pool is scaled by one factor (the mix of hardware is kept; sizes in whole nodes),
and a size "waits" when its simulated trainer wait fraction is above the target. From the
planned sizes (factor 1) the search first probes the factor the measured wait suggests (a
trainer waiting a share ``w`` of its time needs ``1 / (1 - w)`` times the rollout supply, if the
nodes are what limits it: ``1.1 / (1 - w)`` with a tenth to spare, at least 1.25) and then
doubles (while the trainer waits) or halves (while it does not) until it brackets the boundary,
then bisects the bracket geometrically until its ends are within ``resolution`` of each other
or map to adjacent node counts. A probe of more GPUs that
lowers the wait by less than ``MIN_GAIN`` ends the search (``limited``): pool size is not what
limits that run. A trial's factor is the one its sizes have (whole nodes), not the one asked
for. The answer is the smallest probed factor that did not wait: every probed factor below it
waited and every one at or above it did not, so the answer is monotone in what was probed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Hashable

#: the least a probe of more GPUs must lower the wait by for the search to go on growing
MIN_GAIN = 0.03


@dataclass
class Trial:
    factor: float
    sizes: Hashable
    wait: float

    def waits(self, target: float) -> bool:
        return self.wait > target


@dataclass
class SearchResult:
    target: float
    factor: float | None
    """The smallest probed factor at which the trainer did not wait; None: none up to the cap."""
    sizes: Hashable | None
    trials: list[Trial] = field(default_factory=list)
    limited: bool = False
    """More GPUs did not lower the wait (by ``MIN_GAIN``): something else limits the run."""


def find_scale(measure: Callable[[float], float], sizes: Callable[[float], Hashable], target: float, *,
               base_wait: float | None = None, max_factor: float = 64.0, min_factor: float = 1 / 64,
               resolution: float = 1.25, max_trials: int = 8,
               simulated: Callable[[float], float] = lambda f: f) -> SearchResult:
    """Search the factor at which ``measure(factor)`` (a trainer wait fraction) falls to
    ``target`` or below. ``sizes(factor)`` names the pool sizes a factor gives: factors of the
    same sizes are measured once. ``base_wait``: the wait already measured at factor 1.
    ``simulated(factor)``: the factor those sizes actually have, the one a trial reports."""
    seen: dict[Hashable, Trial] = {}
    trials: list[Trial] = []

    def probe(factor: float) -> Trial:
        key = sizes(factor)
        if key not in seen:
            wait = base_wait if factor == 1.0 and base_wait is not None else measure(factor)
            seen[key] = Trial(simulated(factor), key, wait)
            trials.append(seen[key])
        return seen[key]

    first = probe(1.0)
    lo: Trial | None = first if first.waits(target) else None
    hi: Trial | None = None if first.waits(target) else first
    limited = False
    if lo is not None:  # the supply the measured wait asks for, then doubling
        f = min(max(1.1 / max(1.0 - lo.wait, 1e-3), 1.25), max_factor)
        while len(trials) < max_trials:
            t = probe(f)
            if not t.waits(target):
                hi = t
                break
            if t.factor > lo.factor and lo.wait - t.wait < MIN_GAIN:  # more GPUs, (almost) the same wait
                limited = True
                break
            lo = t
            if f >= max_factor:
                break
            f = min(f * 2, max_factor)
    else:
        f = 0.5
        while len(trials) < max_trials and f >= min_factor:
            t = probe(f)
            if t.waits(target):
                lo = t
                break
            hi = t
            if t.sizes == sizes(f / 2):  # every pool is down to one node
                break
            f /= 2
    while lo is not None and hi is not None and len(trials) < max_trials and hi.factor / lo.factor > resolution:
        mid = math.sqrt(lo.factor * hi.factor)
        if sizes(mid) in (lo.sizes, hi.sizes):
            break
        t = probe(mid)
        if t.waits(target):
            lo = t
        else:
            hi = t
    return SearchResult(target, hi.factor if hi else None, hi.sizes if hi else None, trials, limited)
