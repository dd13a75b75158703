"""How a vLLM engine's scores of a version's probe are judged after an update (``vllm_updates``):
how far off the new version, and whether nearer the version the engine held before
(``check_probe``); after a failed update and a fresh engine's scores on the same version, whom
to blame and what tolerance holds from then on (``judge``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from astraflow.probe import probe_error


@dataclass(frozen=True)
class ProbeCheck:
    """What an engine's scores of a version's probe say: ``err`` nats off the new version's
    probe; where the held version's probe has the same tokens, ``err_held`` nats off that one
    and ``apart``, the two probes' distance; ``stale``: the scores are no nearer the new version
    than the held one, although the two are far enough apart for the engine to tell."""

    err: float
    err_held: float | None = None
    apart: float | None = None
    stale: bool = False

    def passed(self, tolerance: float) -> bool:
        return self.err <= tolerance and not self.stale


def check_probe(probe: Mapping[str, Any], got: Sequence[float], held: Mapping[str, Any] | None = None,
                noise: float = 0.0) -> ProbeCheck:
    """Judge an engine's log-probs ``got`` of ``probe["tokens"]`` after an update to ``probe``'s
    version. ``held``: the probe of the version the engine held before, which it scored
    ``noise`` nats off when it verified it (its own error on those weights). An engine on
    either version scores that version's probe about ``noise`` off, so (triangle inequality)
    the other's at least ``apart - noise``: only versions more than ``2 * noise`` apart can be
    told apart, closer ones are judged by ``err`` alone. Without ``held``, or with a probe of
    other tokens (the comparison would mean nothing), only ``err`` is measured."""
    err = probe_error(probe["logprobs"], got)
    if held is None or [int(t) for t in held["tokens"]] != [int(t) for t in probe["tokens"]]:
        return ProbeCheck(err)
    err_held = probe_error(held["logprobs"], got)
    apart = probe_error(held["logprobs"], probe["logprobs"])
    distinct = math.isfinite(apart) and apart > 2 * noise
    return ProbeCheck(err, err_held, apart, stale=distinct and err_held <= err)


#: nats: a fresh engine further off a version's probe (or the tolerance, if higher) is no rounding
NUMERICS_CEILING = 0.5


def judge(err: float, fresh: float, tolerance: float, stale: bool = False,
          fresh_stale: bool = False) -> tuple[float, bool]:
    """``(tolerance, wrong)`` after an update off by ``err`` nats whose version a re-created
    engine scores ``fresh`` nats off (``stale``, ``fresh_stale``: the update's and the fresh
    engine's scores were nearer the version held before, ``ProbeCheck.stale``). A fresh engine
    is right by construction: if it is off by more than ``tolerance`` too, the gap is the
    engine's numerics and the tolerance becomes twice it (at most ``NUMERICS_CEILING``);
    ``wrong``: the update was off by more than the resulting tolerance, or stale where the fresh
    engine is not, so the update path is to blame (a fresh engine as stale says the two
    versions cannot be told apart on it). A fresh engine past the ceiling, or non-finite, says
    the version itself (its weights, their conversion, its probe) is broken: that blames
    neither and keeps the tolerance, which would otherwise pass every later update unchecked."""
    ceiling = max(NUMERICS_CEILING, tolerance)
    if not math.isfinite(fresh) or fresh > ceiling:
        return tolerance, False
    if fresh > tolerance:
        tolerance = min(2 * fresh, ceiling)
    return tolerance, err > tolerance or (stale and not fresh_stale)
