"""Runtime room: the autoscaler's decision, a pure function of signals and partitions.

The rollout pool should be as large as the trainers can use. The balance signal is the
trainers' **wait fraction**: the share of wall time a trainer spends waiting for a batch. Above
``autoscale.high_wait`` rollout is the bottleneck and workers are added; below
``autoscale.low_wait`` the trainers always find data ready and a worker is drained. Optionally
a high share of **stale drops** (sequences dropped because rollout ran too far ahead of
training) also drains.

Nothing flaps, by three rules together:

* **a band**: between ``low_wait`` and ``high_wait`` nothing changes, so a signal oscillating
  inside it is ignored;
* **evidence**: a decision needs ``window_s`` seconds of samples, averaged; the window starts
  after every trainer took its first step, and afresh after every change once the workers it
  started or drained have settled (none submitted, placing, starting or draining);
* **cooldown**: a partition changed less than its ``cooldown_s`` ago is not changed again.

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

    def as_dict(self) -> dict[str, float | None]:
        return {"trainer_wait": self.trainer_wait, "stale_fraction": self.stale_fraction, "evidence_s": self.evidence_s}


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
                       stale_fraction=stale / left if left > 0 else None, evidence_s=span)

    def decide(self, now: float, slots: list[Slot]) -> Decision:
        """The decision for this tick. ``slots`` in config order. An add or a drain restarts the
        window and starts the partition's cooldown."""
        cfg = self.cfg
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
        stale_high = cfg.max_stale_fraction is not None and stale is not None and stale > cfg.max_stale_fraction
        if wait > cfg.high_wait:
            why = f"trainer wait {wait:.0%} > high_wait {cfg.high_wait:.0%}"
            return self._change(now, slots, +1, why, values)
        if wait < cfg.low_wait or stale_high:
            why = (f"trainer wait {wait:.0%} < low_wait {cfg.low_wait:.0%}" if wait < cfg.low_wait else
                   f"stale drops {stale:.0%} > max_stale_fraction {cfg.max_stale_fraction:.0%}")
            return self._change(now, slots, -1, why, values)
        return Decision("hold", f"trainer wait {wait:.0%} within [{cfg.low_wait:.0%}, {cfg.high_wait:.0%}]",
                        values, now)

    def _change(self, now: float, slots: list[Slot], sign: int, why: str, values: dict) -> Decision:
        """Grow the first slot with headroom (sign +1) or drain the last above its minimum (-1),
        skipping slots in their cooldown; hold, saying why, when none can change."""
        order = slots if sign > 0 else list(reversed(slots))
        room = [s for s in order if (s.desired < s.bounds.max_nodes if sign > 0 else s.desired > s.bounds.min_nodes)]
        ready = [s for s in room if now - self.changed_at.get(s.name, float("-inf")) >= s.bounds.cooldown_s]
        if not ready:
            limit = "max_nodes" if sign > 0 else "min_nodes"
            state = "cooling down" if room else f"at {limit}"
            return Decision("hold", f"{why}, but every autoscaled partition is {state}", values, now)
        s = ready[0]
        count = min(self.cfg.step_nodes, s.bounds.max_nodes - s.desired if sign > 0 else s.desired - s.bounds.min_nodes)
        target = s.desired + sign * count
        self.changed_at[s.name] = now
        self.restart_window()
        action: Action = "add" if sign > 0 else "drain"
        return Decision(action, f"{why}: {action} {count} worker(s) of {s.name} ({s.desired} -> {target})", values,
                        now, s.name, count, s.desired, target)
