"""A plan's simulated run is bounded in real time: the automatic time scale and the run's deadline
count the engines' timeline (weight load, a response), a trainer far faster than it is refused
naming the fix, and the run is polled without re-reading its metrics and stopped on SIGHUP too.
The simulated run is a stand-in process here: nothing takes more than a second."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from astraflow.cli import main
from astraflow.plan import planner, simulate
from astraflow.plan.simulate import SimFailed, SimResult, run_sim
from astraflow.rollout.sim_config import PRESETS
from storage.paths import RunPaths

ROOT = Path(__file__).resolve().parents[2]
SIM = str(ROOT / "examples/sim/config.yaml")
TINY = str(ROOT / "examples/tiny/config.yaml")


def _engine_timeline(prompt: int, response: float) -> float:
    """Simulated seconds from a weight version to a sample of it on an H100 preset engine."""
    h = PRESETS["h100"]
    return h.load_seconds + h.ttft_s + prompt / h.prefill_tokens_per_s + response / h.single_tokens_per_s


def _result(pools: dict[str, int], wait: float = 0.5) -> SimResult:
    return SimResult(pools=pools, steps=8, steps_per_s=1.0, trajectories_per_s=1.0, tokens_per_s=1.0,
                     trained_per_s=1.0, trainer_wait=wait, staleness={"p50": 0, "p90": 0, "max": 0},
                     dropped={"stale": 0, "overflow": 0, "filtered": 0})


def _plan(monkeypatch, *args: str) -> tuple[object, list[dict]]:
    """``astraflow plan`` with its simulated runs replaced: the configs they would run are returned."""
    runs: list[dict] = []

    def fake(data, workdir, pools, time_scale, progress=None, deadline_s=None):
        runs.append(data)
        return _result(pools)

    monkeypatch.setattr(planner, "run_sim", fake)
    return CliRunner().invoke(main, ["plan", *args]), runs


def test_a_fast_trainer_gets_a_time_scale_that_runs_the_engines_timeline_in_bounded_real_time(monkeypatch):
    res, runs = _plan(monkeypatch, SIM, "--pool", "h100=8", "--step-seconds", "0.1", "--minutes", "0.01",
                      "--no-search")
    assert res.exit_code == 0, res.output
    (data,) = runs
    scale = data["rollout"]["engine"]["sim"]["time_scale"]
    # a weight load and a response take seconds of real time, not minutes (0.05 stretched them twenty-fold)
    assert _engine_timeline(64, 200) / scale <= 10.0


def test_the_deadline_counts_the_engines_timeline_at_a_slow_time_scale(monkeypatch):
    res, runs = _plan(monkeypatch, SIM, "--pool", "h100=8", "--step-seconds", "0.1", "--minutes", "0.01",
                      "--no-search", "--time-scale", "0.05")
    assert res.exit_code == 0, res.output
    (data,) = runs
    steps = data["run"]["max_steps"]
    assert data["run"]["timeout_s"] >= steps * _engine_timeline(64, 200) / 0.05  # one timeline a step fits


def test_a_trainer_far_faster_than_the_engines_is_refused_naming_the_fix(monkeypatch):
    """A tiny model's step derived from its FLOPs is microseconds: no time scale runs both (its
    size given, so no model need be built here)."""
    res, runs = _plan(monkeypatch, TINY, "--pool", "h100=8", "--no-search", "--model-params", "800000")
    assert res.exit_code == 2, res.output
    out = " ".join(res.output.split())
    assert "--step-seconds" in out and "--time-scale" in out and "fewer --minutes" not in out
    assert not runs


class _FakeRun:
    """Stands for ``astraflow run``: every poll appends one trainer step to its metrics, and after
    ``steps`` of them it exits with ``rc``; ``on_poll(n)`` runs at each poll."""

    def __init__(self, args, steps: int, rc: int, on_poll=lambda n: None):
        self.metrics = RunPaths(Path(args[args.index("--run-dir") + 1])).metrics
        self.metrics.parent.mkdir(parents=True)
        self.pid, self.returncode, self.steps, self.rc, self.on_poll = -1, None, steps, rc, on_poll
        self.written = self.polls = 0
        self.terminated = False

    def poll(self):
        if self.returncode is None and not self.terminated:
            self.polls += 1
            self.on_poll(self.polls)
            if self.written < self.steps:
                with self.metrics.open("a") as fh:
                    fh.write(json.dumps({"step": self.written + 1, "loss": 0.0, "policy": "p"}) + "\n")
                self.written += 1
            if self.written == self.steps:
                self.returncode = self.rc
        return self.returncode

    def terminate(self):
        self.terminated, self.returncode = True, -15

    def wait(self, timeout=None):
        return self.returncode

    kill = terminate


@pytest.fixture
def fake_run(monkeypatch):
    """``run_sim`` starting `_FakeRun` (its options given here) with no second between polls; the
    stop signals' handlers are put back afterwards (a stopped run leaves its own in place)."""
    held = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    made: list[_FakeRun] = []

    def start(**kw):
        monkeypatch.setattr(simulate.subprocess, "Popen", lambda args, **_: made.append(_FakeRun(args, **kw))
                            or made[-1])
        return made

    monkeypatch.setattr(simulate, "time", SimpleNamespace(time=time.time, sleep=lambda s: None))
    yield start
    for s, h in held.items():
        signal.signal(s, h)


def test_a_run_that_took_most_steps_by_its_deadline_names_the_time_scale_not_the_pools(fake_run, tmp_path):
    fake_run(steps=7, rc=1)
    with pytest.raises(SimFailed) as err:
        run_sim({"run": {"max_steps": 8, "timeout_s": 0.0}}, tmp_path, {"h100": 8}, 0.5)
    msg = str(err.value)
    assert "took 7 of its 8 steps" in msg and "--time-scale" in msg and "plan larger pools" not in msg


def test_polling_reads_only_what_the_run_appended(fake_run, tmp_path, monkeypatch):
    offsets: list[int] = []
    real = simulate.tail_records

    def spy(path, offset):
        offsets.append(offset)
        return real(path, offset)

    monkeypatch.setattr(simulate, "tail_records", spy)
    fake_run(steps=6, rc=1)
    with pytest.raises(SimFailed, match="exited with 1"):
        run_sim({"run": {"max_steps": 6, "timeout_s": 600.0}}, tmp_path, {"h100": 8}, 1.0)
    polled = offsets[1:]  # the first poll finds the file empty
    assert polled and all(b > a for a, b in zip(polled, polled[1:]))  # each poll starts where the last ended


def test_sighup_stops_the_simulated_run(fake_run, tmp_path):
    """A closed terminal (SIGHUP) stops the plan's run as Ctrl-C does (a handler of the test's
    own stands in for SIGHUP's default, which would end the test's process)."""
    signal.signal(signal.SIGHUP, lambda *a: None)
    made = fake_run(steps=20, rc=0, on_poll=lambda n: n == 2 and signal.raise_signal(signal.SIGHUP))
    with pytest.raises(KeyboardInterrupt):
        run_sim({"run": {"max_steps": 20, "timeout_s": 600.0}}, tmp_path, {"h100": 8}, 1.0)
    assert made[0].terminated and made[0].written < 20
