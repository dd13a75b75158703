"""The autoscaler on trainers that consume whole batches, sampled once a tick as in a run.

A window spanning one or two training steps counts one batch one time and two the next: read as
demand, that is the load halving, and the "load fell" exception of the memory would drain back
to a pool size known to starve the trainers, again and again, on a load that never changed. A
steady load must settle after its first changes; a load that really falls must still drain."""

from __future__ import annotations

import pytest

from astraflow.runtime.autoscale import Autoscaler, Sample, Slot
from astraflow.sections import AutoscaleConfig
from schedulers.partition import AutoscaleBounds

#: docs/autoscaling.md's example settings
DOCS = dict(high_wait=0.3, low_wait=0.05, window_s=30.0)

#: simulation steps per second (events fall between the ticks that sample them)
RES = 20


class Batches:
    """One trainer fed by a rollout pool: each worker adds ``per_worker`` sequences a second to a
    buffer holding at most two batches; the trainer takes a whole ``batch`` once it is there,
    trains ``step_s(t)`` seconds, and waits while the buffer lacks a batch. The autoscaler samples
    its counters every ``tick_s`` and its decisions apply at once, as in the orchestrator."""

    def __init__(self, cfg: AutoscaleConfig, nodes: int, batch: int, per_worker: float, step_s,
                 lo: int = 1, hi: int = 4, cooldown: float = 60.0, tick_s: float = 1.0):
        self.scaler = Autoscaler(cfg)
        self.slot = Slot("rollout", nodes, AutoscaleBounds(min_nodes=lo, max_nodes=hi, cooldown_s=cooldown))
        self.batch, self.per_worker, self.step_s, self.tick_s = batch, per_worker, step_s, tick_s
        self.n = 0  # simulation steps so far
        self.next_tick = tick_s
        self.buf = self.wait = 0.0
        self.training = 0  # simulation steps left in the current training step
        self.consumed = self.steps = 0
        self.decisions = []

    def run(self, seconds: float) -> Batches:
        for _ in range(round(seconds * RES)):
            self.n += 1
            t = self.n / RES
            self.buf = min(self.buf + self.slot.desired * self.per_worker / RES, 2 * self.batch)
            if self.training:
                self.training -= 1
                self.steps += not self.training
            elif self.buf >= self.batch:
                self.buf -= self.batch
                self.consumed += self.batch
                self.training = round(self.step_s(t) * RES)
            else:
                self.wait += 1 / RES
            if t + 1e-9 >= self.next_tick:
                self.next_tick += self.tick_s
                self._tick(t)
        return self

    def _tick(self, t: float) -> None:
        # a trainer before its first committed step is starting up, as `sample_of` says
        self.scaler.observe(Sample(t, {"solver": self.wait}, 0, self.consumed, started=self.steps >= 1))
        d = self.scaler.decide(t, [self.slot])
        self.decisions.append(d)
        if d.action != "hold":
            self.slot = Slot(self.slot.name, d.target, self.slot.bounds)

    def changes(self):
        return [(d.action, d.desired, d.target) for d in self.decisions if d.action != "hold"]


def steady(seconds: float):
    return lambda t: seconds


ADD = [("add", 1, 2)]


@pytest.mark.parametrize("step_s, per_worker, start, settled", [
    (20.0, 8.0, 1, ADD),    # one worker starves the trainer (37.5 % of a cycle), two never; a window holds 1-2 steps
    (20.0, 10.0, 1, ADD),   # one worker: 22 % of a cycle, but a 30 s window can catch more: added, then kept
    (20.0, 8.0, 2, [("drain", 2, 1)] + ADD),  # a first drain to a size never seen, then back
    (14.0, 12.0, 1, ADD),
])
def test_a_steady_load_in_whole_batches_settles_and_never_flaps(step_s, per_worker, start, settled):
    cfg = AutoscaleConfig(**DOCS)
    run = Batches(cfg, start, batch=256, per_worker=per_worker, step_s=steady(step_s))
    run.run(cfg.memory_period_s - 60)  # within the memory: no retry of a starved size is due
    assert run.changes() == settled  # the initial convergence, then no add/drain cycle
    assert not any("load fell" in d.reason for d in run.decisions)
    assert "but at 1 worker(s) the trainers waited" in run.decisions[-1].reason


def test_the_demo_pace_does_not_flap_either():
    # a 2 s step, a batch of 32, a 3 s window, ticks a little over a second: one worker starves the
    # trainer by about a third, two never do (the shape of a real sim run that flapped)
    cfg = AutoscaleConfig(high_wait=0.3, low_wait=0.05, window_s=3.0)
    run = Batches(cfg, 1, batch=32, per_worker=10.5, step_s=steady(2.0), hi=2, cooldown=2.0, tick_s=1.03)
    run.run(cfg.memory_period_s - 10)
    assert run.changes() == [("add", 1, 2)]


def test_a_load_that_really_falls_still_drains():
    # the step time doubles at t=900: the trainer then needs 6.4 sequences a second, one worker makes 8
    cfg = AutoscaleConfig(**DOCS)
    run = Batches(cfg, 1, batch=256, per_worker=8.0, step_s=lambda t: 20.0 if t < 900 else 40.0)
    run.run(900)
    assert run.changes() == [("add", 1, 2)]
    run.run(600)
    assert run.changes() == [("add", 1, 2), ("drain", 2, 1)] and run.slot.desired == 1
    drain = next(d for d in run.decisions if d.action == "drain")
    assert drain.t > 900 and "their load fell since 1 worker(s) starved them" in drain.reason
    assert drain.t < 900 + cfg.memory_period_s  # the fall, not the memory's expiry
    run.run(1200)
    assert run.slot.desired == 1 and len(run.changes()) == 2  # one worker is now enough


def test_a_load_that_falls_by_less_than_the_band_keeps_the_worker():
    # 20 s -> 25 s a step: the demand falls by a fifth (to 10.2 sequences a second), less than the band's 30 %,
    # and one worker (8) would still starve the trainer: the size remembered as starved stays out of reach
    cfg = AutoscaleConfig(**DOCS)
    run = Batches(cfg, 1, batch=256, per_worker=8.0, step_s=lambda t: 20.0 if t < 900 else 25.0)
    run.run(1700)
    assert run.changes() == [("add", 1, 2)]


def _mark(t, consumed, wait=0.0, gap=1.0, batch=32, policies=("solver",)):
    from astraflow.runtime.autoscale import Mark

    return Mark(Sample(t, {p: wait for p in policies}, 0, consumed), gap, batch)


def test_demand_is_a_range_that_holds_the_true_load():
    from astraflow.runtime.autoscale import Demand, measure

    # a batch of 32 every 2 s, no wait, seen at ticks up to 1 s after each: 16 a second
    got = measure([_mark(2.5, 32), _mark(4.2, 64), _mark(6.9, 96)], policies=1)
    assert isinstance(got, Demand) and got.batches == 2
    assert got.lo <= 16.0 <= got.hi
    assert got.lo == pytest.approx(64 / (4.4 + 1)) and got.hi == pytest.approx(64 / (4.4 - 1))
    # too few events to say; two policies: one batch of the other may be miscounted at the ends
    assert measure([_mark(2.5, 32), _mark(4.2, 64)], policies=1) is None
    two = measure([_mark(2.5, 32), _mark(4.2, 64), _mark(6.9, 96)], policies=2)
    assert two.lo == pytest.approx(32 / 5.4) and two.hi == pytest.approx(96 / 3.4)


def test_a_trainer_that_finished_leaves_the_demand_a_range():
    # its last sample no longer names the policy: the demand is still over the events' policies
    scaler = Autoscaler(AutoscaleConfig(**DOCS))
    for t, consumed in ((0.0, 0), (2.5, 32), (4.2, 64), (6.9, 96)):
        scaler.observe(Sample(t, {"solver": 0.0}, 0, consumed))
    scaler.observe(Sample(7.9, {}, 0, 96))
    got = scaler.demand()
    assert got is not None and got.lo <= 16.0 <= got.hi
