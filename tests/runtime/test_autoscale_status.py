"""How the autoscaler's numbers read: its reasons never contradict themselves through rounding,
and `astraflow status` tells its trainer wait (over the window) from the wait since the start
that the policies and the balance line show."""

from __future__ import annotations

import json

import pytest

from astraflow.runtime.autoscale import Autoscaler, Sample, Slot
from astraflow.runtime.monitoring.text import autoscale_lines, format_status
from astraflow.sections import AutoscaleConfig
from schedulers.partition import AutoscaleBounds
from storage.paths import RunPaths
from tests.monitoring.test_damaged_status import _status


def _decide(wait_fraction: float, cfg: AutoscaleConfig, nodes: int = 2):
    scaler = Autoscaler(cfg)
    for t in range(int(cfg.window_s) + 2):
        scaler.observe(Sample(float(t), {"solver": wait_fraction * t}, 0, 10 * t))
    return scaler.decide(cfg.window_s + 1, [Slot("r", nodes, AutoscaleBounds(min_nodes=1, max_nodes=4))])


@pytest.mark.parametrize("wait, shown", [(0.304, "30.4% > high_wait 30%"), (0.3004, "30.04% > high_wait 30%"),
                                         (0.56, "56.0% > high_wait 30%")])
def test_a_wait_just_above_the_threshold_never_reads_as_equal_to_it(wait, shown):
    d = _decide(wait, AutoscaleConfig(high_wait=0.3, low_wait=0.05, window_s=10.0))
    assert d.action == "add" and d.signals["trainer_wait"] == pytest.approx(wait)
    assert d.reason.startswith(f"trainer wait over the last 10 s {shown}: add 1 worker(s) of r"), d.reason


def test_thresholds_show_as_set_and_a_wait_just_below_one_shows_below_it():
    d = _decide(0.0499, AutoscaleConfig(high_wait=0.305, low_wait=0.05, window_s=10.0))
    assert d.action == "drain" and d.reason.startswith("trainer wait over the last 10 s 4.99% < low_wait 5%: drain")
    d = _decide(0.2, AutoscaleConfig(high_wait=0.305, low_wait=0.05, window_s=10.0))
    assert d.action == "hold" and d.reason == "trainer wait over the last 10 s 20.0% within [5%, 30.5%]"


def test_status_tells_the_wait_since_the_start_from_the_wait_over_the_window(tmp_path):
    st = _status(RunPaths(tmp_path / "run").make())
    cfg = AutoscaleConfig(high_wait=0.3, low_wait=0.05, window_s=60.0)
    st["autoscale"]["last"] = _decide(0.0, cfg, nodes=1).as_dict()  # at min_nodes: a hold saying why
    out = format_status(st)
    assert "wait 20% since start  buffer 8" in out  # the policy's line
    assert "balance since start: trainer wait 20%, rollout idle 10%" in out
    assert "autoscale: band [5%, 30%] of the trainer wait over the last 60s" in out
    assert "  now: hold: trainer wait over the last 60 s 0.0% < low_wait 5%, but every autoscaled partition" in out
    assert autoscale_lines(None) == []


def test_the_balance_line_leaves_out_a_trainer_that_took_its_last_step(tmp_path):
    """Two policies, one done after a run of waiting (its wait since start stays high): the
    balance says the wait of the trainer still training, as the autoscaler counts it, and which
    one is done; once all are done it says theirs."""
    st = _status(RunPaths(tmp_path / "run").make())
    st["trainers"] = {"solver": {"version": 40, "done": True, "wait_fraction": 0.72, "last_metrics": {}},
                      "verifier": {"version": 11, "done": False, "wait_fraction": 0.08, "last_metrics": {}}}
    assert "balance since start: trainer wait 8% (solver done), rollout idle 10%" in format_status(st)
    st["trainers"]["verifier"]["done"] = True
    assert "balance since start: trainer wait 72%, rollout idle 10%" in format_status(st)


def test_a_resumed_run_goes_on_showing_the_changes_made_before_it(tmp_path):
    """A requeued job resumes the run: its status and dashboard show the changes of the runs
    before it (the autoscale log's), not an empty history; a line cut short is left out."""
    from astraflow.runtime.autoscale import Decision
    from astraflow.runtime.autoscaling import AutoscaleDriver
    from astraflow.runtime.monitoring.view import _autoscale_view
    from astraflow.runtime.progress import Progress

    paths = RunPaths(tmp_path / "run").make()
    paths.control.mkdir(parents=True, exist_ok=True)
    before = [Decision("add", "trainer wait ... > high_wait 30%: add 1 worker(s) of r (1 -> 2)", {"trainer_wait": 0.5},
                       10.0, "r", 1, 1, 2).as_dict(),
              Decision("drain", "trainer wait ... < low_wait 5%: drain 1 worker(s) of r (2 -> 1)", {}, 20.0,
                       "r", 1, 2, 1).as_dict()]
    paths.autoscale_log.write_text("".join(json.dumps(r) + "\n" for r in before) + '{"t": 30.0, "act')
    driver = AutoscaleDriver(AutoscaleConfig(), paths, None, None, Progress(enabled=False))
    st = driver.status()
    assert st["changes"] == before
    assert [c.action for c in _autoscale_view(st).changes] == ["add", "drain"]


def test_a_resumed_run_says_when_it_starts_a_partition_at_another_size_than_the_autoscaler_left(tmp_path):
    """A resume starts the partitions at their config's ``nodes``: one the autoscaler had grown is
    named, with both sizes; one left at the config's size says nothing."""
    from types import SimpleNamespace

    from astraflow.runtime.autoscale import Decision
    from astraflow.runtime.autoscaling import AutoscaleDriver
    from astraflow.runtime.progress import Progress

    paths = RunPaths(tmp_path / "run").make()
    paths.control.mkdir(parents=True, exist_ok=True)
    logged = [Decision("add", "wait: add 2 worker(s) of r (1 -> 3)", {}, 10.0, "r", 2, 1, 3).as_dict(),
              Decision("add", "wait: add 1 worker(s) of s (1 -> 2)", {}, 11.0, "s", 1, 1, 2).as_dict(),
              Decision("drain", "idle: drain 1 worker(s) of s (2 -> 1)", {}, 12.0, "s", 1, 2, 1).as_dict()]
    paths.autoscale_log.write_text("".join(json.dumps(r) + "\n" for r in logged))
    bounds = SimpleNamespace(min_nodes=1, max_nodes=4)
    parts = SimpleNamespace(partitions={"r": SimpleNamespace(nodes=1, autoscale=bounds),
                                        "s": SimpleNamespace(nodes=1, autoscale=bounds)})
    notes: list[str] = []
    progress = Progress(enabled=False)
    progress.note = notes.append
    AutoscaleDriver(AutoscaleConfig(), paths, parts, None, progress)
    assert notes == ["autoscale: partition r resumes at its config's 1 node(s); the autoscaler had it at 3 before, "
                     "and scales it from 1 again"]
