"""Runtime room: the autoscaler's decision, a pure function of signals and partitions.

The rollout pool should be as large as the trainers can use. The balance signal is the
trainers' **wait fraction**: the share of wall time a trainer spends waiting for a batch. Above
``autoscale.high_wait`` rollout is the bottleneck and workers are added; below
``autoscale.low_wait`` the trainers always find data ready and a worker is drained. Optionally
a high share of **stale drops** (sequences dropped because rollout ran too far ahead of
training) also drains.

Nothing flaps, by four rules together:

* **a band**: between ``low_wait`` and ``high_wait`` nothing changes, so a signal oscillating
  inside it is ignored;
* **evidence**: a decision needs ``window_s`` seconds of samples, averaged; the window starts
  after every trainer took its first step, and afresh after every change once the workers it
  started or drained have settled (none submitted, placing, starting or draining);
* **cooldown**: a partition changed less than its ``cooldown_s`` ago is not changed again;
* **memory**: what each window showed is remembered per pool size (the rollout workers of all
  rollout partitions). A drain never goes back to a size at which the trainers waited above
  ``high_wait`` within the last ``memory_s``, unless their load fell since: see `_load_fell`.
  Without it a pool where one worker moves the wait across the whole band (starved with N,
  idle with N + 1) would add and drain forever.

**Demand**, what the "load fell" exception judges, is not read off the window: trainers consume
whole batches, so a window's count is a batch more or less than the load, and a window spanning
one or two steps would read as the load halving or doubling. It is measured between consumption
events (ticks at which the ``consumed`` count rose): from one to the latest, at least
``DEMAND_BATCHES`` batches apart, reaching back past the window as far as that needs (never past
the last change), and taken as the range the quantisation leaves (`Demand`): each event happened
within the tick before it was seen, and with several policies the span's ends may miscount one
batch of each other policy. The load fell only if that whole range now lies below
``1 - high_wait`` of the low end of the highest range seen at this size, so a steady load never
reads as a fall, whatever its batch size, step time or window.

Scale from zero: with no rollout worker wanted in any rollout partition while a trainer trains,
the trainers can never take a first step (so the evidence never starts): one worker of the first
autoscaled partition is added at once. So a drain never leaves none either (the add would follow).

Which partition: growing takes the first partition in config order with headroom (below its
``max_nodes``), shrinking the last one above its ``min_nodes``, so the partitions listed first
(list the cheapest or most available first) are the first grown and the last drained.

`Autoscaler` does no I/O and reads no clock: the orchestrator (`autoscaling`) feeds it one
`Sample` per tick and the partitions' `Slot`s, and applies its `Decision`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from math import inf
from typing import Literal

from astraflow.sections import AutoscaleConfig
from schedulers.partition import AutoscaleBounds

Action = Literal["add", "drain", "hold"]


def pct(threshold: float) -> str:
    """A configured threshold as a percentage, as precise as it was set (0.3: 30%, 0.305: 30.5%);
    the status text shows the band with it too, so both read alike."""
    return f"{100 * threshold:.6g}%"


def _vs(value: float, threshold: float) -> str:
    """A measured fraction compared with ``threshold``, as a percentage with one decimal, or more
    where fewer would round it onto the threshold: a reason never reads as false (30.0% > 30%)."""
    digits = 1
    while digits < 6 and round(100 * value, digits) == round(100 * threshold, digits):
        digits += 1
    return f"{value:.{digits}%}"


@dataclass(frozen=True)
class Sample:
    """The cumulative counters read once per tick (differences over the window are the signals)."""

    t: float
    """When they were read (seconds, any epoch)."""
    wait_s: dict[str, float]
    """Per training policy (trainers that finished are left out): seconds its trainer has waited
    for batches so far, the current wait included."""
    stale_dropped: int = 0
    """Sequences dropped as too stale, all policies together."""
    consumed: int = 0
    """Sequences consumed by the trainers, all policies together."""
    started: bool = True
    """Every training trainer committed a step: what a trainer waits before its first batch is
    start-up (nodes loading, the first rollouts), not a lack of rollout capacity."""


@dataclass(frozen=True)
class Signals:
    """What one window of samples says."""

    trainer_wait: float | None
    """The largest wait fraction of a trainer over the window; None with no training trainer."""
    stale_fraction: float | None
    """Stale drops / (stale drops + consumed) over the window; None when nothing left the buffers."""
    evidence_s: float
    """Seconds the window spans."""
    consumed_per_s: float | None = None
    """Sequences the trainers consumed per second over the window, all policies together."""

    def as_dict(self) -> dict[str, float | None]:
        return {"trainer_wait": self.trainer_wait, "stale_fraction": self.stale_fraction, "evidence_s": self.evidence_s,
                "consumed_per_s": self.consumed_per_s}


@dataclass(frozen=True)
class Seen:
    """What the latest full window at one pool size showed (the autoscaler's memory)."""

    wait: float
    """The trainers' wait fraction (the largest)."""
    delivered: float | None
    """Sequences the trainers consumed per second (at least, `Demand.delivered_lo`, where the
    consumption events span enough batches; else the window's count): at a size where they
    waited, what that pool delivered."""
    t: float
    """When."""


#: batches (after the first) a demand estimate spans at least: one step's time alone is noise
DEMAND_BATCHES = 2


@dataclass(frozen=True)
class Mark:
    """A consumption event: the sample at which the ``consumed`` count rose."""

    sample: Sample
    gap_s: float
    """Seconds since the sample before: the event happened within them."""
    batch: int
    """Sequences it added (one batch, or more when several were consumed within the tick)."""


@dataclass(frozen=True)
class Demand:
    """The trainers' load between two consumption events, as the range whole batches and
    tick-timed samples leave (module docstring, *Demand*)."""

    lo: float
    """Sequences a second of not waiting, at least (their load, whatever the pool)."""
    hi: float
    """... at most (inf when the span may hold no busy time)."""
    delivered_lo: float
    """Sequences a second of the span, at least: while the trainers starve, what the pool delivers."""
    batches: int
    """Consumption events in the span after its first."""


def measure(marks: list[Mark], policies: int) -> Demand | None:
    """The demand between the first and the last of ``marks``: the sequences consumed after the
    first over the span less the largest wait of a policy. The true span differs from the sampled
    one by less than a tick at each end (the last event may be a tick earlier: shorter; the first
    too: longer); with ``policies`` > 1 the count may miss or gain one batch of each other policy.
    None with fewer than ``DEMAND_BATCHES`` events after the first or no time between them."""
    if len(marks) < DEMAND_BATCHES + 1:
        return None
    first, last = marks[0].sample, marks[-1].sample
    span = last.t - first.t
    waits = [last.wait_s[p] - first.wait_s[p] for p in last.wait_s if p in first.wait_s]
    if span <= 0 or not waits:
        return None
    busy = span - min(max(max(waits), 0.0), span)
    slack = max(policies - 1, 0) * max(m.batch for m in marks)
    count = last.consumed - first.consumed
    low = max(count - slack, 0)
    head, tail = marks[0].gap_s, marks[-1].gap_s
    return Demand(lo=low / (busy + head), hi=(count + slack) / (busy - tail) if busy > tail else inf,
                  delivered_lo=low / (span + head), batches=len(marks) - 1)


@dataclass(frozen=True)
class Slot:
    """A rollout partition the autoscaler may change."""

    name: str
    desired: int
    """Its ``nodes`` now (the desired worker count)."""
    bounds: AutoscaleBounds
    settling: int = 0
    """Its workers still submitted, placing, starting or draining, or wanted but not submitted."""
    stuck: int = 0
    """Its workers submitted longer ago than a worker's start deadline and not joined yet (a queue
    that holds them): not waited for, and the partition is not grown while they wait."""


@dataclass(frozen=True)
class Decision:
    """Add or drain ``count`` workers of ``partition`` (``desired`` -> ``target``), or hold."""

    action: Action
    reason: str
    signals: dict[str, float | None]
    t: float
    partition: str | None = None
    count: int = 0
    desired: int | None = None
    target: int | None = None

    def as_dict(self) -> dict:
        return {"t": self.t, "action": self.action, "partition": self.partition, "count": self.count,
                "desired": self.desired, "target": self.target, "reason": self.reason, "signals": dict(self.signals)}


@dataclass
class Autoscaler:
    """Decides, from samples and partitions, whether to add, drain or hold (module docstring)."""

    cfg: AutoscaleConfig
    samples: deque[Sample] = field(default_factory=deque)
    #: when each partition was last changed by a decision
    changed_at: dict[str, float] = field(default_factory=dict)
    #: per pool size (rollout workers wanted in all rollout partitions), what its latest full window showed
    seen: dict[int, Seen] = field(default_factory=dict)
    #: the consumption events since the window last restarted: those of the window, the one before
    #: it, and at least ``DEMAND_BATCHES + 1``
    marks: deque[Mark] = field(default_factory=deque)
    #: the pool size now and the highest low end of the trainers' demand (`Demand.lo`) seen at it
    #: since it was reached
    stay: tuple[int, float | None] = (-1, None)

    def observe(self, sample: Sample) -> None:
        """Add one tick's counters; keep the window's worth (plus the one sample before it), and the
        consumption events `measure` needs. A counter that went down (a restarted trainer or data
        layer counts afresh) restarts the window."""
        if self.samples:
            prev = self.samples[-1]
            if (sample.stale_dropped < prev.stale_dropped or sample.consumed < prev.consumed
                    or any(sample.wait_s[p] < prev.wait_s[p] for p in sample.wait_s if p in prev.wait_s)):
                self.restart_window()
            elif sample.consumed > prev.consumed:
                self.marks.append(Mark(sample, sample.t - prev.t, sample.consumed - prev.consumed))
        self.samples.append(sample)
        while len(self.samples) > 2 and sample.t - self.samples[1].t >= self.cfg.window_s:
            self.samples.popleft()
        while len(self.marks) > DEMAND_BATCHES + 1 and sample.t - self.marks[1].sample.t >= self.cfg.window_s:
            self.marks.popleft()

    def restart_window(self) -> None:
        """Forget the evidence: what follows a change is measured afresh."""
        self.samples.clear()
        self.marks.clear()

    def demand(self) -> Demand | None:
        """The trainers' demand over the kept consumption events (`measure`)."""
        # the policies of the latest event: a trainer that finished since is no longer sampled
        return measure(list(self.marks), len(self.marks[-1].sample.wait_s)) if self.marks else None

    def signals(self) -> Signals | None:
        """The window's signals; None before there are two samples."""
        if len(self.samples) < 2:
            return None
        first, last = self.samples[0], self.samples[-1]
        span = last.t - first.t
        if span <= 0:
            return None
        waits = [(last.wait_s[p] - first.wait_s[p]) / span for p in last.wait_s if p in first.wait_s]
        stale = last.stale_dropped - first.stale_dropped
        left = stale + last.consumed - first.consumed
        return Signals(trainer_wait=min(max(waits), 1.0) if waits else None,
                       stale_fraction=stale / left if left > 0 else None, evidence_s=span,
                       consumed_per_s=(last.consumed - first.consumed) / span)

    def decide(self, now: float, slots: list[Slot], fixed: int = 0, others_settling: int = 0) -> Decision:
        """The decision for this tick. ``slots`` in config order; ``fixed``: the workers wanted in
        rollout partitions without bounds (they count in the pool size); ``others_settling``: workers
        of the other rollout partitions still starting or draining (added or removed by hand), which
        hold it as the slots' own do. An add or a drain restarts the window and starts the
        partition's cooldown."""
        cfg = self.cfg
        pool = sum(s.desired for s in slots) + fixed
        if pool == 0 and self.samples and self.samples[-1].wait_s:
            return self._from_zero(now, slots)
        if self.samples and not self.samples[-1].started:
            self.restart_window()
            return Decision("hold", "waiting for the trainers' first steps (start-up waits are not a signal)", {}, now)
        settling = sum(s.settling for s in slots) + others_settling
        if settling:
            self.restart_window()
            return Decision("hold", f"waiting for {settling} worker(s) to start or drain", {}, now)
        sig = self.signals()
        if sig is None or sig.evidence_s < cfg.window_s:
            have = sig.evidence_s if sig else 0.0
            return Decision("hold", f"collecting evidence ({have:.0f} of {cfg.window_s:.0f} s)",
                            sig.as_dict() if sig else {}, now)
        need = self.demand()
        values = sig.as_dict() | ({"demand_per_s_lo": need.lo, "demand_per_s_hi": need.hi if need.hi < inf else None}
                                  if need else {})
        wait, stale = sig.trainer_wait, sig.stale_fraction
        if wait is None:
            return Decision("hold", "no trainer is training", values, now)
        self.seen = {n: x for n, x in self.seen.items() if now - x.t < cfg.memory_period_s}
        # what this size delivered: over the consumption events when they span enough batches,
        # else the window's count (an add usually follows one window; a batch more or less there
        # only matters once the load has been seen to fall, `_load_fell`)
        self.seen[pool] = Seen(wait, need.delivered_lo if need else sig.consumed_per_s, now)
        known = [v for v in (need.lo if need else None, self.stay[1] if self.stay[0] == pool else None)
                 if v is not None]
        self.stay = (pool, max(known, default=None))
        stale_high = cfg.max_stale_fraction is not None and stale is not None and stale > cfg.max_stale_fraction
        said = f"trainer wait over the last {cfg.window_s:g} s"  # not the wait since the start `status` shows too
        if wait > cfg.high_wait:
            why = f"{said} {_vs(wait, cfg.high_wait)} > high_wait {pct(cfg.high_wait)}"
            return self._change(now, slots, +1, why, values)
        if wait < cfg.low_wait or stale_high:
            why = (f"{said} {_vs(wait, cfg.low_wait)} < low_wait {pct(cfg.low_wait)}" if wait < cfg.low_wait else
                   f"stale drops {_vs(stale, cfg.max_stale_fraction)} > max_stale_fraction "
                   f"{pct(cfg.max_stale_fraction)}")
            spare, held, fell = self._drain_room(now, pool, need)
            if fell:
                why += f" (their load fell since {fell} worker(s) starved them)"
            return self._change(now, slots, -1, why, values, (spare, held))
        return Decision("hold", f"{said} {wait:.1%} within [{pct(cfg.low_wait)}, {pct(cfg.high_wait)}]",
                        values, now)

    def _drain_room(self, now: float, pool: int, need: Demand | None) -> tuple[int, str, int | None]:
        """How many workers a drain may take off the pool of ``pool``, why not more, and the largest
        starved size forgotten because the load fell (None if none): down to one above the largest
        remembered size below it at which the trainers waited above ``high_wait`` (unless their
        load fell since), and never to zero workers."""
        cfg = self.cfg
        starved = [n for n, x in self.seen.items() if n < pool and x.wait > cfg.high_wait]
        kept = [n for n in starved if not self._load_fell(self.seen[n], need)]
        fell = max((n for n in starved if n not in kept and not any(k > n for k in kept)), default=None)
        if not kept:
            return pool - 1, "that would leave no rollout worker", fell
        n = max(kept)
        x = self.seen[n]
        left = cfg.memory_period_s - (now - x.t)
        return pool - n - 1, (f"at {n} worker(s) the trainers waited {_vs(x.wait, cfg.high_wait)} (> high_wait "
                              f"{pct(cfg.high_wait)}) "
                              f"{now - x.t:.0f} s ago: no drain back to {n} for {left:.0f} s unless their load "
                              "falls"), fell

    def _load_fell(self, x: Seen, need: Demand | None) -> bool:
        """The trainers' load fell since the pool of ``x`` starved them: at this pool size their
        demand, at its most, fell to at most ``1 - high_wait`` of the highest seen here at its least
        (a change at one size, so no comparison across sizes that counts could mislead), and what
        the pool of ``x`` delivered (`Seen.delivered`) would now keep their wait within
        ``high_wait``. Too few consumption events here, or none at ``x``, say nothing."""
        hw, peak = self.cfg.high_wait, self.stay[1]
        if not (need and peak and x.delivered):
            return False
        return need.hi <= (1 - hw) * peak and 1 - x.delivered / need.hi <= hw

    def _from_zero(self, now: float, slots: list[Slot]) -> Decision:
        """No rollout worker is wanted anywhere while a trainer trains: without one the trainers
        never take a step, so no evidence ever comes. Add one worker at once (no cooldown)."""
        why = "no rollout worker in any rollout partition, so the trainers cannot take a step"
        room = [s for s in slots if s.desired < s.bounds.max_nodes]
        if not room:
            return Decision("hold", f"{why}, and no autoscaled partition can grow", {}, now)
        s = room[0]
        sig = self.signals()
        self.changed_at[s.name] = now
        self.restart_window()
        return Decision("add", f"{why}: add 1 worker(s) of {s.name} ({s.desired} -> {s.desired + 1})",
                        sig.as_dict() if sig else {}, now, s.name, 1, s.desired, s.desired + 1)

    def _change(self, now: float, slots: list[Slot], sign: int, why: str, values: dict,
                most: tuple[int, str] | None = None) -> Decision:
        """Grow the first slot with headroom (sign +1) or drain the last above its minimum (-1),
        skipping slots in their cooldown and changing at most ``most`` workers (the count and why
        not more); hold, saying why, when none can change."""
        order = slots if sign > 0 else list(reversed(slots))
        room = [s for s in order if (s.desired < s.bounds.max_nodes and not s.stuck if sign > 0
                                     else s.desired > s.bounds.min_nodes)]
        spare, held = most or (self.cfg.step_nodes, "")
        if room and spare <= 0:
            return Decision("hold", f"{why}, but {held}", values, now)
        ready = [s for s in room if now - self.changed_at.get(s.name, float("-inf")) >= s.bounds.cooldown_s]
        if not slots:
            return Decision("hold", f"{why}, but no active partition has autoscale bounds", values, now)
        if not ready:
            if room:
                left = min(s.bounds.cooldown_s - (now - self.changed_at[s.name]) for s in room)
                state = f"cooling down ({left:.0f} s left)"
            elif sign > 0 and any(s.stuck for s in slots):
                state = "at max_nodes or has workers its queue holds back"
            else:
                state = f"at {'max_nodes' if sign > 0 else 'min_nodes'}"
            return Decision("hold", f"{why}, but every autoscaled partition is {state}", values, now)
        s = ready[0]
        count = min(self.cfg.step_nodes, spare,
                    s.bounds.max_nodes - s.desired if sign > 0 else s.desired - s.bounds.min_nodes)
        target = s.desired + sign * count
        self.changed_at[s.name] = now
        self.restart_window()
        action: Action = "add" if sign > 0 else "drain"
        return Decision(action, f"{why}: {action} {count} worker(s) of {s.name} ({s.desired} -> {target})", values,
                        now, s.name, count, s.desired, target)
