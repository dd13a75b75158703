"""The autoscaler's memory of pool sizes and its scale from zero, on scripted signals.

A pool where one worker moves the trainers' wait across the whole band (starved with N workers,
idle with N + 1), or where staleness drains a worker the trainers then miss, must settle instead
of adding and draining forever; the memory must still let the pool drain once the load really
falls (seen in what the trainers consume, or once the memory expires). A run whose rollout
partitions start with no worker must get one, or the trainers never take a first step."""

from __future__ import annotations

import pytest

from astraflow.config import ClusterConfig, config_from_dict
from astraflow.runtime.autoscale import Autoscaler, Sample, Slot
from astraflow.runtime.autoscaling import AutoscaleDriver
from astraflow.runtime.control import read_desired_file, write_desired
from astraflow.runtime.monitoring import Tick
from astraflow.runtime.progress import Progress
from astraflow.runtime.reconcile import PartitionSet
from astraflow.sections import AutoscaleConfig
from schedulers.partition import AutoscaleBounds, Partition
from storage.paths import RunPaths

#: docs/autoscaling.md's example settings
DOCS = dict(high_wait=0.3, low_wait=0.05, window_s=30.0)


class Pool:
    """One autoscaled partition fed, once a second, with what the trainers do at its current
    size: ``profile(t, nodes) -> (wait fraction, sequences consumed per s, stale drops per s)``.
    Decisions are applied at once and the workers settle at once, as in the orchestrator."""

    def __init__(self, cfg: AutoscaleConfig, nodes: int, lo: int = 1, hi: int = 4, cooldown: float = 60.0):
        self.scaler = Autoscaler(cfg)
        self.slot = Slot("rollout", nodes, AutoscaleBounds(min_nodes=lo, max_nodes=hi, cooldown_s=cooldown))
        self.t = self.wait = self.consumed = self.stale = 0.0
        self.decisions = []

    def run(self, seconds: int, profile) -> "Pool":
        for _ in range(seconds):
            wait, consumed, stale = profile(self.t, self.slot.desired)
            self.t += 1.0
            self.wait += wait
            self.consumed += consumed
            self.stale += stale
            self.scaler.observe(Sample(self.t, {"solver": self.wait}, round(self.stale), round(self.consumed)))
            d = self.scaler.decide(self.t, [self.slot])
            self.decisions.append(d)
            if d.action != "hold":
                self.slot = Slot(self.slot.name, d.target, self.slot.bounds)
        return self

    def changes(self):
        return [(d.action, d.desired, d.target) for d in self.decisions if d.action != "hold"]

    def after_first_add(self):
        changes = self.changes()
        return changes[changes.index(next(c for c in changes if c[0] == "add")) + 1:]


def supply(demand=100.0, per_worker: float = 60.0):
    """Each worker delivers ``per_worker`` sequences a second; the trainers take up to
    ``demand`` (a callable of t, or a number) and wait the rest of the time."""
    def profile(t, n):
        d = demand(t) if callable(demand) else demand
        got = min(d, n * per_worker)
        return 1 - got / d, got, 0.0
    return profile


@pytest.mark.parametrize("consumed", ["as the wait implies", "constant", "not counted"])
def test_one_worker_across_the_whole_band_is_added_once_and_kept(consumed):
    # one worker: the trainers wait 56 %; two or more: never. Without the memory: add, drain, add, ...
    def profile(t, n):
        wait = 0.56 if n == 1 else 0.0
        return wait, {"as the wait implies": 100 * (1 - wait), "constant": 10.0, "not counted": 0.0}[consumed], 0.0

    pool = Pool(AutoscaleConfig(**DOCS), nodes=1).run(1200, profile)
    assert pool.changes()[0] == ("add", 1, 2)
    assert len(pool.after_first_add()) <= 1 and pool.changes() == [("add", 1, 2)]
    assert pool.slot.desired == 2
    last = pool.decisions[-1]
    assert last.action == "hold" and "trainer wait over the last 30 s 0.0% < low_wait 5%" in last.reason
    assert "at 1 worker(s) the trainers waited 56.0% (> high_wait 30%)" in last.reason


@pytest.mark.parametrize("consumed", ["as the wait implies", "constant"])
def test_staleness_does_not_drain_a_worker_the_trainers_then_miss_again_and_again(consumed):
    # a third of the sequences go stale at any size; two workers starve the trainers (35 %), three do not (25 %)
    cfg = AutoscaleConfig(**DOCS, max_stale_fraction=0.2)

    def profile(t, n):
        wait = {2: 0.35, 3: 0.25}[n]
        consumed_per_s = 100 * (1 - wait) if consumed == "as the wait implies" else 60.0
        return wait, consumed_per_s, consumed_per_s / 2

    pool = Pool(cfg, nodes=3, lo=2).run(1200, profile)
    assert pool.changes()[:2] == [("drain", 3, 2), ("add", 2, 3)]
    assert len(pool.after_first_add()) <= 1 and len(pool.changes()) == 2
    assert pool.slot.desired == 3  # the trainers' wait outranks the stale drops, as the rule says
    last = pool.decisions[-1]
    assert "stale drops 33.3% > max_stale_fraction 20%" in last.reason
    assert "at 2 worker(s) the trainers waited 35.0%" in last.reason


def test_a_load_that_falls_drains_the_worker_it_no_longer_needs():
    # the trainers need 100 sequences a second, later 20: what one worker delivered (60) is then plenty
    profile = supply(demand=lambda t: 100.0 if t < 300 else 20.0)
    pool = Pool(AutoscaleConfig(**DOCS), nodes=1).run(1200, profile)
    assert pool.changes() == [("add", 1, 2), ("drain", 2, 1)] and pool.slot.desired == 1
    drain = next(d for d in pool.decisions if d.action == "drain")
    assert drain.t > 300 and "their load fell since 1 worker(s) starved them" in drain.reason
    assert pool.decisions[-1].reason.startswith("trainer wait over the last 30 s 0.0% < low_wait 5%, but every "
                                                "autoscaled partition is at min_nodes")


def test_a_load_that_falls_only_a_little_keeps_the_worker():
    # 100 -> 90 sequences a second: one worker (60) would still starve the trainers (33 %)
    profile = supply(demand=lambda t: 100.0 if t < 300 else 90.0)
    pool = Pool(AutoscaleConfig(**DOCS), nodes=1).run(1200, profile)
    assert pool.changes() == [("add", 1, 2)]
    assert "at 1 worker(s) the trainers waited 40.0%" in pool.decisions[-1].reason


def test_the_memory_expires_so_a_fall_the_counts_do_not_show_still_drains():
    # no consumption counts (the load-fell shortcut has nothing to go on): only the memory's expiry
    def profile(t, n):
        wait = 0.56 if n == 1 and t < 200 else 0.0  # from t=200 one worker is enough
        return wait, 0.0, 0.0

    kept = Pool(AutoscaleConfig(**DOCS), nodes=1).run(1200, profile)
    assert kept.changes() == [("add", 1, 2)]  # the default memory outlasts this run
    assert AutoscaleConfig(**DOCS).memory_period_s > 1200

    pool = Pool(AutoscaleConfig(**DOCS, memory_s=400.0), nodes=1).run(1200, profile)
    assert pool.changes() == [("add", 1, 2), ("drain", 2, 1)] and pool.slot.desired == 1
    add, drain = [d for d in pool.decisions if d.action != "hold"]
    assert drain.t - add.t >= 400.0  # not before the memory of the starved size expired
    held = [d for d in pool.decisions if add.t < d.t < drain.t and "< low_wait" in d.reason]
    assert held and all("at 1 worker(s) the trainers waited 56.0%" in d.reason for d in held)


def test_a_drain_of_several_workers_stops_above_the_size_remembered_as_starved():
    # each worker delivers 60 sequences a second, the trainers take 100: one worker starves them (40 %)
    pool = Pool(AutoscaleConfig(**DOCS, step_nodes=3), nodes=2, lo=1, hi=4)
    pool.run(600, supply(demand=100.0, per_worker=60.0))
    # 2 -> 1 (never known to starve), 1 -> 4 (step_nodes 3), then down only to 2, the size above the starved one
    assert pool.changes() == [("drain", 2, 1), ("add", 1, 4), ("drain", 4, 2)] and pool.slot.desired == 2
    assert "at 1 worker(s) the trainers waited 40.0%" in pool.decisions[-1].reason


# ---------------------------------------------------------------- scale from zero

def _starting_samples(scaler: Autoscaler, seconds: int, started: bool = False) -> None:
    for t in range(seconds):  # a trainer that has not taken its first step waits all the time
        scaler.observe(Sample(float(t), {"solver": float(t)}, started=started))


def test_an_empty_rollout_pool_gets_one_worker_at_once():
    scaler = Autoscaler(AutoscaleConfig(**DOCS))
    _starting_samples(scaler, 3)
    bounds = AutoscaleBounds(min_nodes=0, max_nodes=2, cooldown_s=60.0)
    d = scaler.decide(3.0, [Slot("spot", 0, bounds), Slot("dear", 0, bounds)])
    assert (d.action, d.partition, d.desired, d.target) == ("add", "spot", 0, 1)
    assert "no rollout worker in any rollout partition" in d.reason
    scaler.observe(Sample(4.0, {"solver": 4.0}, started=False))
    d = scaler.decide(4.0, [Slot("spot", 1, bounds, settling=1), Slot("dear", 0, bounds)])
    assert d.action == "hold" and "first steps" in d.reason  # one is enough to start; then the usual rule
    # a worker of a partition without bounds is a pool: nothing to add
    other = Autoscaler(AutoscaleConfig(**DOCS))
    _starting_samples(other, 3)
    assert other.decide(3.0, [Slot("spot", 0, bounds)], fixed=1).action == "hold"
    # no trainer training (all finished): an empty pool stays empty
    done = Autoscaler(AutoscaleConfig(**DOCS))
    done.observe(Sample(0.0, {}))
    assert done.decide(0.0, [Slot("spot", 0, bounds)]).action == "hold"


def test_busy_trainers_never_drain_the_last_worker():
    pool = Pool(AutoscaleConfig(**DOCS), nodes=2, lo=0, hi=2, cooldown=0.0)
    pool.run(200, lambda t, n: (0.0, 10.0, 0.0))
    assert pool.changes() == [("drain", 2, 1)] and pool.slot.desired == 1
    assert "that would leave no rollout worker" in pool.decisions[-1].reason


def test_a_config_whose_autoscaled_rollout_starts_empty_runs_and_grows_to_one_worker(tmp_path):
    cfg = config_from_dict({
        "policies": [{"name": "solver", "model": "sim", "trainer": {"backend": "sim"}}],
        "workload": {"name": "sim", "workflow": "sim"},
        "rollout": {"engine": {"type": "sim"}},
        "autoscale": {"high_wait": 0.3, "low_wait": 0.05},
        "partitions": [{"name": "data", "role": "data"}, {"name": "trainer", "role": "trainer"},
                       {"name": "r", "role": "rollout", "nodes": 0, "autoscale": {"min_nodes": 0, "max_nodes": 2}}],
    })
    part = cfg.partitions[2]
    paths = RunPaths(tmp_path / "run").make()
    write_desired(paths, [part])
    pset = PartitionSet([part], paths, ClusterConfig(), Progress(enabled=False))

    class NoWorkers:
        def in_partition(self, name):
            return []

    driver = AutoscaleDriver(cfg.autoscale, paths, pset, NoWorkers(), Progress(enabled=False))
    tick = Tick(data_layer={"counts": {}}, trainers={"solver": {"version": 0, "done": False, "wait_total_s": 1.0}})
    d = driver.step(tick, now=1.0)
    assert (d.action, d.partition, d.desired, d.target) == ("add", "r", 0, 1)
    assert read_desired_file(paths)[0]["r"].nodes == 1

    # a rollout partition without bounds that has a worker: the pool is not empty, nothing to add
    fixed = Partition(name="fixed", nodes=1)
    write_desired(paths, [Partition(name="r", nodes=0, autoscale={"min_nodes": 0, "max_nodes": 2}), fixed])
    pset = PartitionSet([cfg.partitions[2], fixed], paths, ClusterConfig(), Progress(enabled=False))
    driver = AutoscaleDriver(cfg.autoscale, paths, pset, NoWorkers(), Progress(enabled=False))
    assert driver.fixed() == 1
    d = driver.step(tick, now=1.0)
    assert d.action == "hold" and "first steps" in d.reason and read_desired_file(paths)[0]["r"].nodes == 0


def _one_serving(tmp_path, max_nodes: int, cfg: AutoscaleConfig):
    """A driver over one autoscaled partition ``r`` (1..``max_nodes``) whose one worker serves."""
    from types import SimpleNamespace

    part = Partition(name="r", nodes=1, autoscale={"min_nodes": 1, "max_nodes": max_nodes, "cooldown_s": 0})
    paths = RunPaths(tmp_path / "run").make()
    write_desired(paths, [part])
    pset = PartitionSet([part], paths, ClusterConfig(), Progress(enabled=False))

    class OneServing:
        def in_partition(self, name):
            return [SimpleNamespace(gone=False, phase="serving", draining=False)]

    return paths, pset, AutoscaleDriver(cfg, paths, pset, OneServing(), Progress(enabled=False))


def test_a_resumed_runs_start_up_waits_are_not_a_signal(tmp_path):
    """A resumed run's trainers start past v0: their waits until the first step after the resume
    are start-up, as on a fresh run; once one step is taken, a starved trainer gets a worker."""
    paths, pset, driver = _one_serving(tmp_path, 2, AutoscaleConfig(high_wait=0.3, low_wait=0.05, window_s=2.0))

    def step(t: float, version: int):
        trainers = {"solver": {"version": version, "done": False, "wait_total_s": 0.9 * t}}
        return driver.step(Tick(data_layer={"counts": {"solver": {"consumed": int(t)}}}, trainers=trainers), now=t)

    held = [step(float(t), 4) for t in range(10)]  # resumed at v4, 90 % waiting while it starts
    assert all(d.action == "hold" and "first steps" in d.reason for d in held), [d.reason for d in held]
    assert read_desired_file(paths)[0]["r"].nodes == 1
    later = [step(float(t), 5) for t in range(10, 20)]
    assert any(d.action == "add" for d in later), [d.reason for d in later]


def test_the_serving_workers_of_a_failed_partition_count_in_the_pool(tmp_path):
    """A partition failed for its refills may still have a worker rolling out: the pool is not
    empty (the scale-from-zero path would add at once, past the evidence and the cooldown)."""
    from types import SimpleNamespace

    auto = Partition(name="r", nodes=0, autoscale={"min_nodes": 0, "max_nodes": 2})
    old = Partition(name="old", nodes=2)
    paths = RunPaths(tmp_path / "run").make()
    write_desired(paths, [auto, old])
    pset = PartitionSet([auto, old], paths, ClusterConfig(), Progress(enabled=False))
    pset.state["old"].state = "failed"

    class OneLeft:
        def in_partition(self, name):
            return [SimpleNamespace(gone=False, phase="serving", draining=False)] if name == "old" else []

    driver = AutoscaleDriver(AutoscaleConfig(), paths, pset, OneLeft(), Progress(enabled=False))
    assert driver.fixed() == 1
    tick = Tick(data_layer={"counts": {}}, trainers={"solver": {"version": 3, "done": False, "wait_total_s": 1.0}})
    d = driver.step(tick, now=1.0)
    assert d.action == "hold" and "no rollout worker" not in d.reason, d.reason


def test_a_partition_given_back_after_failed_adds_is_not_grown_again_for_the_memory(tmp_path):
    """Its added workers kept failing and it went back to those that serve: growing it again at
    once would repeat the failures for the whole run."""
    import time

    _, pset, driver = _one_serving(tmp_path, 3, AutoscaleConfig(memory_s=100.0))
    now = time.time()
    assert driver.slots(now)[0].stuck == 0
    pset.state["r"].shrunk_at = now - 10
    assert driver.slots(now)[0].stuck == 1  # held back from growth
    assert driver.slots(now + 100)[0].stuck == 0  # the memory has passed
