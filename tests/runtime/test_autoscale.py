"""The autoscaler's decision on scripted signals: it grows when trainers wait, drains when they
never do, stays within bounds, respects cooldowns and the evidence window, and never flaps on a
signal that moves inside its band. Also the config checks that guard it."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from astraflow.config import ClusterConfig, config_from_dict
from astraflow.runtime.autoscale import Autoscaler, Sample, Slot
from astraflow.runtime.autoscaling import AutoscaleDriver
from astraflow.runtime.monitoring import Tick
from astraflow.runtime.control import read_desired_file, set_partition_nodes, write_desired
from astraflow.runtime.progress import Progress
from astraflow.runtime.reconcile import PartitionSet
from astraflow.runtime.workers import Worker
from astraflow.sections import AutoscaleConfig
from schedulers import JobRef
from schedulers.partition import AutoscaleBounds, Partition
from storage.paths import RunPaths

CFG = AutoscaleConfig(high_wait=0.3, low_wait=0.05, window_s=10.0)


class Script:
    """Feeds an autoscaler one sample per second whose window has the given wait fraction, and
    applies its decisions to the slots as the orchestrator would (the workers settle at once)."""

    def __init__(self, cfg: AutoscaleConfig, slots: list[Slot]):
        self.scaler = Autoscaler(cfg)
        self.slots = slots
        self.t = 0.0
        self.wait = 0.0
        self.stale = self.consumed = 0
        self.decisions = []

    def run(self, seconds: int, wait_fraction, stale_per_s: int = 0, consumed_per_s: int = 10):
        for i in range(seconds):
            self.t += 1.0
            self.wait += wait_fraction(i) if callable(wait_fraction) else wait_fraction
            self.stale += stale_per_s
            self.consumed += consumed_per_s
            self.scaler.observe(Sample(self.t, {"solver": self.wait}, self.stale, self.consumed))
            d = self.scaler.decide(self.t, self.slots)
            self.decisions.append(d)
            if d.action != "hold":
                self.slots = [Slot(s.name, d.target, s.bounds) if s.name == d.partition else s for s in self.slots]
        return self

    def actions(self):
        return [(d.action, d.partition, d.desired, d.target) for d in self.decisions if d.action != "hold"]

    def nodes(self):
        return {s.name: s.desired for s in self.slots}


def slot(name, desired, lo=1, hi=3, cooldown=0.0):
    return Slot(name, desired, AutoscaleBounds(min_nodes=lo, max_nodes=hi, cooldown_s=cooldown))


def test_waiting_trainers_grow_the_first_partition_with_headroom_up_to_its_max():
    s = Script(CFG, [slot("cheap", 1, hi=2), slot("dear", 1, hi=3)]).run(60, 0.8)
    # every change needs a fresh window of evidence: one change per ~10 s, cheap first, then dear
    assert s.actions()[:3] == [("add", "cheap", 1, 2), ("add", "dear", 1, 2), ("add", "dear", 2, 3)]
    assert s.nodes() == {"cheap": 2, "dear": 3}  # both at max_nodes, never past it
    last = s.decisions[-1]
    assert last.action == "hold" and "at max_nodes" in last.reason
    first = next(d for d in s.decisions if d.action == "add")
    assert first.t >= CFG.window_s and first.signals["trainer_wait"] == pytest.approx(0.8)
    assert "trainer wait over the last 10 s 80.0% > high_wait 30%" in first.reason


def test_busy_trainers_drain_the_last_partition_down_to_its_min():
    s = Script(CFG, [slot("cheap", 2, lo=1), slot("dear", 2, lo=1)]).run(60, 0.0)
    assert s.actions()[:2] == [("drain", "dear", 2, 1), ("drain", "cheap", 2, 1)]
    assert s.nodes() == {"cheap": 1, "dear": 1}
    assert "at min_nodes" in s.decisions[-1].reason


def test_no_decision_before_a_full_window_of_evidence():
    s = Script(CFG, [slot("a", 1)]).run(9, 1.0)
    assert s.actions() == [] and all("collecting evidence" in d.reason for d in s.decisions)
    s.run(2, 1.0)
    assert s.actions() == [("add", "a", 1, 2)]


def test_cooldown_holds_a_partition_changed_recently():
    s = Script(CFG, [slot("a", 1, hi=5, cooldown=35.0)]).run(60, 0.9)
    times = [d.t for d in s.decisions if d.action == "add"]
    assert len(times) == 2 and times[1] - times[0] >= 35.0
    cooling = [d.reason for d in s.decisions if "cooling down" in d.reason]
    assert cooling and all(" s left)" in r for r in cooling), cooling  # how long it still holds


def test_a_pool_without_an_active_autoscaled_partition_says_so():
    """An autoscaled partition removed mid-run, a fixed one left: nothing can be changed, and
    the reason must not claim a partition is at its bounds."""
    scaler = Autoscaler(CFG)
    for t in range(1, 13):  # a fixed partition's one worker; the trainer waits 90 % of the time
        scaler.observe(Sample(float(t), {"solver": 0.9 * t}, 0, 10 * t))
        d = scaler.decide(float(t), [], fixed=1)
    assert d.action == "hold" and "no active partition has autoscale bounds" in d.reason, d.reason


def test_a_signal_oscillating_inside_the_band_never_changes_anything():
    # wait swings between 6 % and 28 % every other second, and in slow waves: always inside [5 %, 30 %]
    s = Script(CFG, [slot("a", 2)]).run(120, lambda i: 0.06 if i % 2 else 0.28)
    s.run(120, lambda i: 0.06 if (i // 15) % 2 else 0.28)
    assert s.actions() == [] and s.nodes() == {"a": 2}
    assert "within [5%, 30%]" in s.decisions[-1].reason


def test_settling_workers_hold_and_restart_the_window():
    scaler = Autoscaler(CFG)
    for t in range(20):
        scaler.observe(Sample(float(t), {"solver": 0.9 * t}))
    d = scaler.decide(20.0, [Slot("a", 2, AutoscaleBounds(max_nodes=4), settling=1)])
    assert d.action == "hold" and "to start or drain" in d.reason
    assert scaler.signals() is None  # the evidence after the change is gathered afresh


def test_stale_drops_drain_unless_trainers_starve():
    cfg = AutoscaleConfig(high_wait=0.3, low_wait=0.05, window_s=10.0, max_stale_fraction=0.2)
    s = Script(cfg, [slot("a", 3)]).run(12, 0.1, stale_per_s=5, consumed_per_s=10)
    drain = next(d for d in s.decisions if d.action == "drain")
    assert s.actions() == [("drain", "a", 3, 2)] and "stale drops 33.3% > max_stale_fraction 20%" in drain.reason
    s = Script(cfg, [slot("a", 2)]).run(12, 0.6, stale_per_s=5, consumed_per_s=10)
    assert s.actions() == [("add", "a", 2, 3)]


def test_finished_trainers_and_restarted_counters_give_no_signal():
    scaler = Autoscaler(CFG)
    for t in range(15):
        scaler.observe(Sample(float(t), {}))
    assert scaler.decide(15.0, [slot("a", 2)]).reason == "no trainer is training"
    scaler = Autoscaler(CFG)
    for t in range(15):  # a trainer restarted at t=10 counts its wait from 0 again: not a busy trainer
        scaler.observe(Sample(float(t), {"solver": 0.2 * t if t < 10 else 0.2 * (t - 10)}))
    d = scaler.decide(15.0, [slot("a", 2)])
    assert d.action == "hold" and "collecting evidence (4 of 10 s)" in d.reason


# ---------------------------------------------------------------- config

BASE = {
    "policies": [{"name": "solver", "model": "sim", "trainer": {"backend": "sim"}}],
    "workload": {"name": "sim", "workflow": "sim"},
    "rollout": {"engine": {"type": "sim"}},
}


def _cfg(**extra):
    parts = [{"name": "data", "role": "data"}, {"name": "trainer", "role": "trainer"}, *extra.pop("rollout_parts")]
    return config_from_dict({**BASE, **extra, "partitions": parts})


def test_config_errors_name_the_fix():
    bounded = [{"name": "r", "role": "rollout", "nodes": 1, "autoscale": {"min_nodes": 1, "max_nodes": 3}}]
    cfg = config_from_dict({**BASE, "autoscale": {}, "partitions": [
        {"name": "data", "role": "data"}, {"name": "trainer", "role": "trainer"}, *bounded]})
    assert cfg.autoscale.high_wait == 0.3 and cfg.partitions[2].autoscale.max_nodes == 3
    with pytest.raises(ValueError, match="add one"):
        _cfg(rollout_parts=bounded)
    with pytest.raises(ValueError, match="no partition has bounds"):
        _cfg(autoscale={}, rollout_parts=[{"name": "r", "role": "rollout"}])
    with pytest.raises(ValueError, match="low_wait 0.4 must be below high_wait"):
        AutoscaleConfig(low_wait=0.4, high_wait=0.3)
    with pytest.raises(ValidationError, match="30 reads as a percentage.*write 0.3 for 30 %"):
        AutoscaleConfig(high_wait=30)
    with pytest.raises(ValidationError, match="write 0.2 for 20 %"):
        AutoscaleConfig(max_stale_fraction=20)
    with pytest.raises(ValidationError, match="set nodes between min_nodes and max_nodes"):
        Partition(name="r", nodes=5, autoscale={"max_nodes": 3})
    with pytest.raises(ValidationError, match="make min_nodes <= max_nodes"):
        Partition(name="r", nodes=2, autoscale={"min_nodes": 3, "max_nodes": 2})
    with pytest.raises(ValidationError, match="remove its autoscale section"):
        Partition(name="t", role="trainer", autoscale={"max_nodes": 2})


# ---------------------------------------------------------------- applying a decision

class _Fleet:
    """The calls reconciliation makes on the worker state machine, recorded."""

    def __init__(self, workers):
        self.workers = {w.name: w for w in workers}
        self.removed: list[tuple[str, bool]] = []

    def in_partition(self, name):
        return [w for w in self.workers.values() if w.partition == name]

    def remove(self, w, drain):
        self.removed.append((w.name, drain))
        w.enter("draining")


def _worker(i: int, phase: str) -> Worker:
    name = f"rollout-r-local-cpu-{i}"
    return Worker(job=JobRef(job_id=f"local-{i}", partition="r", worker_name=name, kind="local", log=None),
                  partition="r", phase=phase)


def test_a_lowered_node_count_drains_workers_not_serving_first_then_the_newest(tmp_path):
    paths = RunPaths(tmp_path / "run").make()
    part = Partition(name="r", nodes=4, autoscale={"min_nodes": 1, "max_nodes": 4})
    other = Partition(name="s", nodes=0)
    write_desired(paths, [part, other], {"gone": "now"})
    pset = PartitionSet([part, other], paths, ClusterConfig(), Progress(enabled=False))
    fleet = _Fleet([_worker(0, "serving"), _worker(1, "serving"), _worker(2, "starting"), _worker(3, "serving")])
    written = set_partition_nodes(paths, "r", 2)
    assert written.nodes == 2 and written.autoscale == part.autoscale
    parts, removals = read_desired_file(paths)
    assert list(parts) == ["r", "s"] and removals == {"gone": "now"}  # order and removals kept
    pset.reconcile(fleet, address_for=lambda p: "tcp://unused")
    assert fleet.removed == [("rollout-r-local-cpu-2", True), ("rollout-r-local-cpu-3", True)]
    pset.reconcile(fleet, address_for=lambda p: "tcp://unused")  # draining workers are not counted twice
    assert len(fleet.removed) == 2 and pset.partitions["r"].nodes == 2
    with pytest.raises(ValueError, match="outside its autoscale bounds"):
        set_partition_nodes(paths, "r", 5)
    assert set_partition_nodes(paths, "nosuch", 1) is None


def test_the_driver_reads_the_tick_and_writes_the_change_where_partitions_add_would(tmp_path):
    paths = RunPaths(tmp_path / "run").make()
    part = Partition(name="r", nodes=1, autoscale={"min_nodes": 1, "max_nodes": 3, "cooldown_s": 0})
    write_desired(paths, [part])
    pset = PartitionSet([part], paths, ClusterConfig(), Progress(enabled=False))
    fleet = _Fleet([_worker(0, "serving")])
    notes = []
    progress = Progress(enabled=False)
    progress.note = notes.append
    driver = AutoscaleDriver(AutoscaleConfig(window_s=5.0), paths, pset, fleet, progress)

    def tick(t, version):  # a trainer that waits 90 % of the time
        return Tick(data_layer={"counts": {"solver": {"consumed": 10 * t, "stale_dropped": 0}}},
                    trainers={"solver": {"version": version, "done": False, "wait_total_s": 0.9 * t}})

    assert "first steps" in driver.step(tick(0, 0), now=0.0).reason  # before the first step: no signal
    decisions = [driver.step(tick(t, 1), now=float(t)) for t in range(1, 8)]
    assert [d.action for d in decisions] == ["hold"] * 5 + ["add", "hold"]
    assert read_desired_file(paths)[0]["r"].nodes == 2
    logged = [json.loads(x) for x in paths.autoscale_log.read_text().splitlines()]
    assert [(x["action"], x["desired"], x["target"]) for x in logged] == [("add", 1, 2)]
    assert logged[0]["signals"]["trainer_wait"] == pytest.approx(0.9)
    assert len(notes) == 1 and "add 1 worker(s) of r (1 -> 2)" in notes[0] and "trainer_wait 0.90" in notes[0]
    st = driver.status()
    assert st["changes"] == logged and st["config"]["window_s"] == 5.0 and st["last"]["action"] == "hold"


def test_partitions_add_refuses_bounds_a_run_without_an_autoscaler_would_ignore(tmp_path):
    import time

    import yaml

    from astraflow.runtime.control import PartitionError, add_partition
    from astraflow.runtime.monitoring import write_orchestrator_info, write_status

    paths = RunPaths(tmp_path / "run").make()
    write_desired(paths, [Partition(name="r", nodes=1)])
    write_orchestrator_info(paths, None, "tcp://127.0.0.1:1")  # "running": this process, status just written
    write_status(paths, {"written_at": time.time(), "run_dir": str(paths.root), "data_layer": {}, "trainers": {},
                         "partitions": {}, "workers": {}})
    bounded = Partition(name="extra", nodes=1, autoscale={"max_nodes": 3})
    with pytest.raises(PartitionError, match="no enabled autoscale section, so nothing would scale it"):
        add_partition(paths.root, bounded)
    paths.config.write_text(yaml.safe_dump({"autoscale": {"high_wait": 0.4}}))
    add_partition(paths.root, bounded)
    assert read_desired_file(paths)[0]["extra"].autoscale.max_nodes == 3


def test_partition_views_sum_nodes_by_their_heartbeat_partition():
    from collections import Counter

    from astraflow.runtime.monitoring.partition_stats import (partition_counts, partition_versions,
                                                              staleness_summary)

    fleet = _Fleet([_worker(0, "serving")])
    dl = {
        "nodes": {
            "rollout-r-local-cpu-0": {"completed": 5, "tokens": 500, "versions": {"solver": 3}},  # no heartbeat yet
            "rollout-h-eu-H100-0.n0": {"partition": "h", "completed": 7, "tokens": 700, "versions": {"solver": 4}},
            "rollout-h-eu-H100-0.n1": {"partition": "h", "completed": 1, "tokens": 100, "versions": {"solver": 2}},
            "rollout-h-eu-H100-1.n0": {"partition": "h", "completed": 2, "tokens": 9, "gone": True,
                                       "versions": {"solver": 1}},
        },
        "consumed_staleness_by_node": {"rollout-h-eu-H100-0.n0": {"0": 3, "2": 1}, "rollout-r-local-cpu-0": {"1": 4}},
    }
    counts = partition_counts(dl, fleet, ["r", "h", "empty"])
    assert counts["h"]["completed"] == 10 and counts["h"]["tokens"] == 809 and counts["r"]["completed"] == 5
    assert counts["h"]["staleness"] == Counter({0: 3, 2: 1}) and counts["empty"]["completed"] == 0
    assert staleness_summary(counts["h"]["staleness"]) == {"consumed": 4, "staleness_mean": 0.5, "staleness_max": 2}
    assert staleness_summary(Counter()) == {"consumed": 0, "staleness_mean": None, "staleness_max": None}
    assert partition_versions(dl, fleet) == {"r": {"solver": [3]}, "h": {"solver": [2, 4]}}  # gone nodes left out


def test_partitions_add_refuses_a_vllm_partition_where_vllm_is_not_installed(tmp_path):
    import time

    from astraflow.rollout.vllm_setup import vllm_available
    from astraflow.runtime.control import PartitionError, add_partition
    from astraflow.runtime.monitoring import write_orchestrator_info, write_status

    if vllm_available():
        pytest.skip("vLLM is installed here: nothing to refuse")
    paths = RunPaths(tmp_path / "run").make()
    write_desired(paths, [Partition(name="r", nodes=1)])
    write_orchestrator_info(paths, None, "tcp://127.0.0.1:1")  # "running": this process, status just written
    write_status(paths, {"written_at": time.time(), "run_dir": str(paths.root), "data_layer": {}, "trainers": {},
                         "partitions": {}, "workers": {}})
    gpus = Partition(name="gpus", nodes=1, rollout={"engine": {"type": "vllm"}})
    with pytest.raises(PartitionError, match=r"partition gpus: rollout.engine.type: vllm needs vLLM.*install"):
        add_partition(paths.root, gpus)
    assert "gpus" not in read_desired_file(paths)[0]
    add_partition(paths.root, Partition(name="cpus", nodes=1))  # the run's own engine: accepted
    assert "cpus" in read_desired_file(paths)[0]


def test_a_worker_its_queue_holds_back_does_not_stop_the_next_partition_growing(tmp_path):
    """The first partition's added worker stays submitted past the start deadline (a Slurm queue
    that holds it): the autoscaler stops waiting for it and grows the next partition instead."""
    import time

    paths = RunPaths(tmp_path / "run").make()
    a = Partition(name="a", nodes=2, autoscale={"min_nodes": 1, "max_nodes": 3, "cooldown_s": 0})
    b = Partition(name="b", nodes=0, autoscale={"min_nodes": 0, "max_nodes": 2, "cooldown_s": 0})
    write_desired(paths, [a, b])
    cluster = ClusterConfig(worker_start_timeout_s=60)
    pset = PartitionSet([a, b], paths, cluster, Progress(enabled=False))

    def worker(i: int, phase: str) -> Worker:
        name = f"rollout-a-local-cpu-{i}"
        return Worker(job=JobRef(job_id=f"local-{i}", partition="a", worker_name=name, kind="local", log=None),
                      partition="a", phase=phase)

    t0 = time.time()
    queued = worker(1, "submitted")
    fleet = _Fleet([worker(0, "serving"), queued])
    driver = AutoscaleDriver(AutoscaleConfig(window_s=5.0), paths, pset, fleet, Progress(enabled=False))

    def step(t: float):
        tick = Tick(data_layer={"counts": {"solver": {"consumed": int(10 * t), "stale_dropped": 0}}},
                    trainers={"solver": {"version": 3 if t == 0 else 4, "done": False, "wait_total_s": 0.9 * t}})
        return driver.step(tick, now=t0 + t)

    step(0.0)  # the trainer first seen at v3, then stepping on
    early = [step(float(t)) for t in range(1, 8)]  # within the deadline: it is waited for
    assert all("waiting for 1 worker(s) to start" in d.reason for d in early), [d.reason for d in early]
    queued.since = t0 - 120  # submitted two minutes ago and still not joined
    later = [step(float(t)) for t in range(8, 20)]
    adds = [(d.partition, d.desired, d.target) for d in later if d.action == "add"]
    assert adds and adds[0] == ("b", 0, 1), [d.reason for d in later]
    assert read_desired_file(paths)[0]["a"].nodes == 2  # not grown further while its worker waits


def test_workers_added_or_removed_by_hand_hold_the_autoscaler_until_they_settle(tmp_path):
    """``partitions add`` of a partition without bounds while the trainers starve: its workers are
    still starting, so the window's wait predates them. The autoscaler waits for them (and then
    for a fresh window) rather than add a worker on that evidence; so does a removed partition's
    draining worker. Before this, it added at once and remembered the new pool size as starved."""
    import time

    paths = RunPaths(tmp_path / "run").make()
    auto = Partition(name="a", nodes=1, autoscale={"min_nodes": 1, "max_nodes": 3, "cooldown_s": 0})
    manual = Partition(name="manual", nodes=2)
    write_desired(paths, [auto, manual])
    pset = PartitionSet([auto, manual], paths, ClusterConfig(), Progress(enabled=False))

    def worker(part: str, i: int, phase: str) -> Worker:
        name = f"rollout-{part}-local-cpu-{i}"
        return Worker(job=JobRef(job_id=f"{part}-{i}", partition=part, worker_name=name, kind="local", log=None),
                      partition=part, phase=phase)

    added = [worker("manual", 0, "starting"), worker("manual", 1, "placing")]
    fleet = _Fleet([worker("a", 0, "serving"), *added])
    driver = AutoscaleDriver(AutoscaleConfig(window_s=5.0), paths, pset, fleet, Progress(enabled=False))
    t0 = time.time()

    def step(t: float):
        tick = Tick(data_layer={"counts": {"solver": {"consumed": int(10 * t), "stale_dropped": 0}}},
                    trainers={"solver": {"version": 1 if t == 0 else 2, "done": False, "wait_total_s": 0.9 * t}})
        return driver.step(tick, now=t0 + t)

    step(0.0)
    early = [step(float(t)) for t in range(1, 10)]
    assert all(d.action == "hold" and "waiting for 2 worker(s)" in d.reason for d in early), [d.reason for d in early]
    assert read_desired_file(paths)[0]["a"].nodes == 1 and not driver.scaler.seen
    for w in added:
        w.enter("serving")
    later = [step(float(t)) for t in range(10, 18)]
    assert [d.action for d in later][:5] == ["hold"] * 5 and "add" in [d.action for d in later]  # a fresh window
    pset.state["manual"].state = "removing"
    added[0].enter("draining")
    d = step(30.0)
    assert d.action == "hold" and "waiting for 1 worker(s)" in d.reason, d.reason
