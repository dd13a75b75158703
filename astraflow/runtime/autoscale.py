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
from typing import Literal

from astraflow.sections import AutoscaleConfig
from schedulers.partition import AutoscaleBounds

Action = Literal["add", "drain", "hold"]


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
    consumed_per_s: float | None
    """Sequences the trainers consumed per second: at a size where they waited, what that pool delivered."""
    t: float
    """When."""


def demand(sig: Signals) -> float | None:
    """Sequences a second the trainers would consume if they never waited: what they consumed per
    second of not waiting (their load, whatever the pool). None without consumption or busy time."""
    if not sig.consumed_per_s or sig.trainer_wait is None or sig.trainer_wait >= 1:
        return None
    return sig.consumed_per_s / (1 - sig.trainer_wait)


@dataclass(frozen=True)
class Slot:
    """A rollout partition the autoscaler may change."""

    name: str
    desired: int
    """Its ``nodes`` now (the desired worker count)."""
    bounds: AutoscaleBounds
    settling: int = 0
    """Its workers still submitted, placing, starting or draining, or wanted but not submitted."""


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
    #: the pool size now and the trainers' highest demand (`demand`) seen at it since it was reached
    stay: tuple[int, float | None] = (-1, None)

    def observe(self, sample: Sample) -> None:
        """Add one tick's counters; keep the window's worth (plus the one sample before it). A
        counter that went down (a restarted trainer or data layer counts afresh) restarts the window."""
        if self.samples:
            prev = self.samples[-1]
            if (sample.stale_dropped < prev.stale_dropped or sample.consumed < prev.consumed
                    or any(sample.wait_s[p] < prev.wait_s[p] for p in sample.wait_s if p in prev.wait_s)):
                self.samples.clear()
        self.samples.append(sample)
        while len(self.samples) > 2 and sample.t - self.samples[1].t >= self.cfg.window_s:
            self.samples.popleft()

    def restart_window(self) -> None:
        """Forget the evidence: what follows a change is measured afresh."""
        self.samples.clear()

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

    def decide(self, now: float, slots: list[Slot], fixed: int = 0) -> Decision:
        """The decision for this tick. ``slots`` in config order; ``fixed``: the workers wanted in
        rollout partitions without bounds (they count in the pool size). An add or a drain
        restarts the window and starts the partition's cooldown."""
        cfg = self.cfg
        pool = sum(s.desired for s in slots) + fixed
        if pool == 0 and self.samples and self.samples[-1].wait_s:
            return self._from_zero(now, slots)
        if self.samples and not self.samples[-1].started:
            self.restart_window()
            return Decision("hold", "waiting for the trainers' first steps (start-up waits are not a signal)", {}, now)
        settling = sum(s.settling for s in slots)
        if settling:
            self.restart_window()
            return Decision("hold", f"waiting for {settling} worker(s) to start or drain", {}, now)
        sig = self.signals()
        if sig is None or sig.evidence_s < cfg.window_s:
            have = sig.evidence_s if sig else 0.0
            return Decision("hold", f"collecting evidence ({have:.0f} of {cfg.window_s:.0f} s)",
                            sig.as_dict() if sig else {}, now)
        values = sig.as_dict()
        wait, stale = sig.trainer_wait, sig.stale_fraction
        if wait is None:
            return Decision("hold", "no trainer is training", values, now)
        self.seen = {n: x for n, x in self.seen.items() if now - x.t < cfg.memory_period_s}
        self.seen[pool] = Seen(wait, sig.consumed_per_s, now)
        need = demand(sig)
        known = [v for v in (need, self.stay[1] if self.stay[0] == pool else None) if v is not None]
        self.stay = (pool, max(known, default=None))
        stale_high = cfg.max_stale_fraction is not None and stale is not None and stale > cfg.max_stale_fraction
        if wait > cfg.high_wait:
            why = f"trainer wait {wait:.0%} > high_wait {cfg.high_wait:.0%}"
            return self._change(now, slots, +1, why, values)
        if wait < cfg.low_wait or stale_high:
            why = (f"trainer wait {wait:.0%} < low_wait {cfg.low_wait:.0%}" if wait < cfg.low_wait else
                   f"stale drops {stale:.0%} > max_stale_fraction {cfg.max_stale_fraction:.0%}")
            spare, held, fell = self._drain_room(now, pool, need)
            if fell:
                why += f" (their load fell since {fell} worker(s) starved them)"
            return self._change(now, slots, -1, why, values, (spare, held))
        return Decision("hold", f"trainer wait {wait:.0%} within [{cfg.low_wait:.0%}, {cfg.high_wait:.0%}]",
                        values, now)

    def _drain_room(self, now: float, pool: int, need: float | None) -> tuple[int, str, int | None]:
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
        return pool - n - 1, (f"at {n} worker(s) the trainers waited {x.wait:.0%} (> high_wait {cfg.high_wait:.0%}) "
                              f"{now - x.t:.0f} s ago: no drain back to {n} for {left:.0f} s unless their load "
                              "falls"), fell

    def _load_fell(self, x: Seen, need: float | None) -> bool:
        """The trainers' load fell since the pool of ``x`` starved them: at this pool size their
        demand fell to at most ``1 - high_wait`` of the highest seen here (a change at one size, so
        no comparison across sizes that counts could mislead), and what the pool of ``x`` delivered
        would now keep their wait within ``high_wait``. A window without consumption says nothing."""
        hw, peak = self.cfg.high_wait, self.stay[1]
        if not (need and peak and x.consumed_per_s):
            return False
        return need <= (1 - hw) * peak and 1 - x.consumed_per_s / need <= hw

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
        room = [s for s in order if (s.desired < s.bounds.max_nodes if sign > 0 else s.desired > s.bounds.min_nodes)]
        spare, held = most or (self.cfg.step_nodes, "")
        if room and spare <= 0:
            return Decision("hold", f"{why}, but {held}", values, now)
        ready = [s for s in room if now - self.changed_at.get(s.name, float("-inf")) >= s.bounds.cooldown_s]
        if not ready:
            limit = "max_nodes" if sign > 0 else "min_nodes"
            state = "cooling down" if room else f"at {limit}"
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
