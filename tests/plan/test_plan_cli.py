"""``astraflow plan``: bad input exits 2 naming the fix; a small config simulated end to end
through the real CLI gives the report's keys; the search's answer is monotone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from astraflow.cli import main
from astraflow.config import RunConfig, load_config
from astraflow.plan.planner import PlanOptions, shape_for
from astraflow.plan.pools import SimShape, parse_pool, sim_config
from astraflow.plan.search import find_scale
from astraflow.plan.simulate import SimFailed, run_sim

ROOT = Path(__file__).resolve().parents[2]
SIM = str(ROOT / "examples/sim/config.yaml")


@pytest.mark.parametrize("args, needle", [
    (["--pool", "h100:64"], "write KIND=GPUS, e.g. --pool h100=64"),
    (["--pool", "v100=8"], "unknown hardware kind 'v100'; use one of h100, a100, cpu, local"),
    (["--pool", "h100=0"], "a pool needs at least 1 GPU"),
    (["--pool", "h100=-8"], "a pool needs at least 1 GPU"),
    (["--pool", "local=1"], "add --calibrate"),
    ([], "give at least one --pool"),
    (["--pool", "h100=8", "--pool", "h100=8"], "each hardware kind once"),
    (["--pool", "h100=8", "--trainer", "h100"], "--trainer 'h100': write KIND=GPUS"),
    (["--pool", "h100=8", "--calibration", "/nonexistent.json"], "not a calibration file"),
    (["--pool", "h100=8", "--minutes", "0"], "--minutes"),
    (["--pool", "h100=8", "--wait-target", "1.5"], "--wait-target"),
    (["--pool", "h100:8", "--calibrate"], "write KIND=GPUS"),  # before any calibration
    (["--pool", "h100=8", "--minutes", "nan"], "nan is not a finite number"),
    (["--pool", "h100=8", "--minutes", "inf"], "inf is not a finite number"),
    (["--pool", "h100=8", "--time-scale", "inf"], "--time-scale"),
    (["--pool", "h100=8", "--step-seconds", "nan"], "--step-seconds"),
    (["--pool", "h100=8", "--trainer", "v100=8"], "unknown trainer GPU kind 'v100'; use one of h100, a100"),
    (["--pool", "h100=8", "--calibrate", "--calibration", "c.json"], "give one of them"),
    (["--pool", "h100=8", "--save-calibration", "c.json"], "add --calibrate"),
    (["--pool", "h100=8", "--no-search", "--search-minutes", "2"], "--no-search skips the search: drop one"),
    (["--pool", "h100=8", "--no-search", "--max-trials", "3"], "--no-search skips the search: drop one"),
    (["--pool", "h100=20"], "20 GPUs are not whole nodes of --gpus-per-node 8; use h100=16 or h100=24"),
    (["--pool", "h100=12"], "12 GPUs are not whole nodes of --gpus-per-node 8; use h100=8 or h100=16"),
])
def test_bad_input_exits_2_naming_the_fix(args, needle):
    res = CliRunner().invoke(main, ["plan", SIM, *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output


def test_a_config_without_a_step_time_names_the_options(tmp_path):
    data = yaml.safe_load(open(ROOT / "examples/math/config.yaml"))
    data["policies"][0]["model"] = str(tmp_path / "absent")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(main, ["plan", str(cfg), "--pool", "a100=8"])
    assert res.exit_code == 2, res.output
    assert "give --step-seconds S (or --model-params N), or --calibrate" in res.output


def test_a_config_of_several_policies_is_refused_naming_the_fix():
    res = CliRunner().invoke(main, ["plan", str(ROOT / "examples/multi_policy/config.yaml"), "--pool", "h100=8",
                                    "--step-seconds", "1"])
    assert res.exit_code == 2, res.output
    assert "astraflow plan simulates one" in res.output and "keeps one policy" in res.output
    assert "Traceback" not in res.output and "errors.pydantic.dev" not in res.output


def test_a_sync_config_is_refused_naming_the_fix():
    """A sync run's trainer idles between its steps, which its wait fraction does not count: a
    plan sized by it would pick the smallest pools."""
    res = CliRunner().invoke(main, ["plan", str(ROOT / "examples/sim/config.yaml"), "--pool", "h100=8",
                                    "--set", "run.mode=sync"])
    assert res.exit_code == 2, res.output
    assert "run.mode is sync" in res.output and "--set run.mode=async" in res.output


def test_a_config_with_an_autoscaler_is_planned_at_fixed_pool_sizes():
    """The autoscaler's bounds name the config's own partitions, which the plan replaces by its
    pools: the simulated run leaves the autoscaler out rather than failing its config check."""
    cfg = load_config(ROOT / "examples/sim/autoscale.yaml")
    assert cfg.autoscale is not None
    shape, _ = shape_for(cfg, PlanOptions())
    data = sim_config(cfg, [parse_pool("h100=16", 8, None)], shape)
    sim = RunConfig.model_validate(data)
    assert sim.autoscale is None and [p.nodes for p in sim.partitions if p.role == "rollout"] == [1]


def _calibration_file(tmp_path: Path) -> Path:
    from astraflow.rollout.sim_config import PRESETS

    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"engine": PRESETS["cpu"].model_dump(), "step_seconds": 1.0, "prompt_tokens": 64,
                                "response_mean": 100.0}))
    return path


@pytest.mark.parametrize("where", ["missing directory", "under a file"])
def test_an_unwritable_save_calibration_exits_2_before_calibrating(tmp_path, monkeypatch, where):
    """Checked before the calibration takes its time: a measurement is never lost to the path."""
    import astraflow.plan.calibrate

    def measure(*args, **kwargs):
        raise AssertionError("calibrated before the path was checked")

    monkeypatch.setattr(astraflow.plan.calibrate, "calibrate", measure)
    (tmp_path / "afile").write_text("")
    path = tmp_path / ("nodir" if where == "missing directory" else "afile") / "cal.json"
    for source in (["--calibrate"], ["--calibration", str(_calibration_file(tmp_path))]):
        res = CliRunner().invoke(main, ["plan", SIM, "--pool", "h100=8", *source, "--save-calibration", str(path)])
        assert res.exit_code == 2, res.output
        assert f"--save-calibration {path}: cannot write there" in res.output, res.output
        assert "create its directory" in res.output and "Traceback" not in res.output
        assert not path.exists()


def test_a_save_calibration_that_fails_while_written_names_the_path(tmp_path):
    from astraflow.plan.planner import Calibration
    from astraflow.plan.pools import PlanError

    cal = Calibration.load(_calibration_file(tmp_path))
    with pytest.raises(PlanError, match="--save-calibration .*nodir/c.json: cannot write there"):
        cal.save(tmp_path / "nodir" / "c.json")


def test_an_unwritable_workdir_exits_2_before_any_simulated_run(tmp_path):
    (tmp_path / "afile").write_text("")
    workdir = tmp_path / "afile" / "sub"
    res = CliRunner().invoke(main, ["plan", SIM, "--pool", "h100=8", "--no-search", "--workdir", str(workdir)])
    assert res.exit_code == 2, res.output
    assert f"--workdir {workdir}: cannot write there (Not a directory)" in res.output, res.output
    assert "give a --workdir directory you can write" in res.output
    assert "Traceback" not in res.output and "simulating" not in res.output


def test_a_missing_workdir_is_made(tmp_path):
    from astraflow.plan.planner import check_workdir

    check_workdir(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_plan_runs_a_small_config_end_to_end(tmp_path):
    """Also: a sim trainer's per-token time and schedule become the one step time reported
    (0.1 s + 6400 loss tokens x 31.25 us = 0.3 s a step), and every simulated step takes it.
    A given time scale keeps the real steps short (the automatic one would make each 2 s real; its
    choice is checked by test_plan_bounds, and the SIGTERM test below starts a plan with it)."""
    sets = ["policies.0.trainer.sim_step_seconds=0.1", "policies.0.trainer.sim_seconds_per_token=0.00003125",
            "policies.0.trainer.sim_step_schedule={2: 0.01}"]
    proc = subprocess.run([sys.executable, "-m", "astraflow", "plan", SIM, "--pool", "h100=2", "--pool", "a100=2",
                           "--gpus-per-node", "1", "--minutes", "0.4", "--no-search", "--json", "--time-scale", "6",
                           *(a for s in sets for a in ("--set", s)),
                           "--workdir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert set(out) == {"assumptions", "pools", "overall", "per_pool", "no_wait"}
    assert out["pools"] == {"h100": 2, "a100": 2} and set(out["per_pool"]) == {"h100", "a100"}
    overall = out["overall"]
    for key in ("steps_per_s", "trajectories_per_s", "tokens_per_s", "trainer_wait", "staleness", "dropped"):
        assert key in overall
    assert overall["steps_per_s"] > 0 and overall["tokens_per_s"] > 0 and 0 <= overall["trainer_wait"] <= 1
    assert set(overall["staleness"]) == {"p50", "p90", "max"} and set(overall["dropped"]) == {"stale", "overflow", "filtered"}
    assert set(overall["dropped_fraction"]) == set(overall["dropped"])
    assert all(f >= 0 for f in overall["dropped_fraction"].values())
    assert sum(p["share"] for p in out["per_pool"].values()) == pytest.approx(1.0)
    assert "plan: step" in proc.stderr  # progress while it ran
    assert out["assumptions"]["step_seconds"] == pytest.approx(3.0)  # 0.3 s x the example's time scale 10
    lines = [json.loads(line) for line in (tmp_path / "sim0/run/metrics.jsonl").read_text().splitlines()]
    step_s = [m["step_s"] for m in lines if "step_s" in m]  # real seconds a step: simulated / time scale
    assert len(step_s) == out["assumptions"]["steps"]
    assert step_s == pytest.approx([3.0 / out["assumptions"]["time_scale"]] * len(step_s))
    # trained/s is the steps' own batches: the sim trainer records how many it trained on
    batch = yaml.safe_load((tmp_path / "sim0/run/config.yaml").read_text())["dataflow"]["batch_size"]
    assert all(m["num_sequences"] == batch for m in lines if "step_s" in m)
    assert overall["trained_per_s"] == pytest.approx(overall["steps_per_s"] * batch)


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_pools_far_too_small_say_so_rather_than_quote_the_run(tmp_path):
    """A pool that cannot fill a batch before the simulated run's deadline: the failure names
    the steps taken and the fix, not the child run's own deadline setting."""
    cfg = load_config(SIM)
    shape = SimShape(step_seconds=0.3, prompt_tokens=64, response_mean=512, response_sigma=0.0, time_scale=1.0,
                     steps=8)
    data = sim_config(cfg, [parse_pool("cpu=1", 1, None)], shape)  # ~80 simulated s for one batch
    data["run"]["timeout_s"] = 15.0
    with pytest.raises(SimFailed, match=r"took \d+ of its 8 steps .* plan larger pools") as err:
        run_sim(data, tmp_path, {"cpu": 1}, 1.0)
    assert "run.timeout_s" not in str(err.value)


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_a_simulated_run_past_its_deadline_is_stopped_and_its_log_quoted(tmp_path):
    """The message carries the end of the run's log: without --workdir its directory is removed."""
    data = sim_config(load_config(SIM), [parse_pool("cpu=1", 1, None)],
                      SimShape(step_seconds=0.3, prompt_tokens=64, response_mean=512, response_sigma=0.0,
                               time_scale=1.0, steps=8))
    with pytest.raises(SimFailed, match=r"passed its deadline of 3s; the end of its log:\n"):
        run_sim(data, tmp_path, {"cpu": 1}, 1.0, deadline_s=3.0)
    pid = int((tmp_path / "run.pid").read_text())
    with pytest.raises(ProcessLookupError):  # the run it started was stopped (and reaped)
        os.kill(pid, 0)


def _wait_model(nodes_needed: float):
    """A trainer that waits until the pools reach ``nodes_needed`` nodes (of 4 planned)."""
    return lambda factor: max(0.0, 1.0 - 4 * factor / nodes_needed)


def _sizes(factor: float):
    return (("h100", max(1, round(4 * factor)) * 8),)


@pytest.mark.parametrize("needed", [1, 3, 4, 7, 20, 60])
def test_the_search_brackets_the_boundary_monotonically(needed):
    res = find_scale(_wait_model(needed), _sizes, 0.05, max_trials=12)
    assert res.factor is not None
    for t in res.trials:  # every probe below the answer waited, every one at or above it did not
        assert t.waits(0.05) == (t.factor < res.factor)
    assert dict(res.sizes)["h100"] >= needed * 8 * 0.95 - 8


def test_a_slower_trainer_needs_no_larger_pools():
    answers = [dict(find_scale(_wait_model(n), _sizes, 0.05, max_trials=12).sizes)["h100"] for n in (2, 6, 12, 30)]
    assert answers == sorted(answers)


def test_the_search_says_when_no_size_is_enough():
    res = find_scale(lambda f: 0.9, _sizes, 0.05, max_factor=8, max_trials=6)
    assert res.factor is None and res.sizes is None and all(t.waits(0.05) for t in res.trials)


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_sigterm_to_plan_stops_its_simulated_run(tmp_path):
    import os
    import signal
    import time

    import psutil

    plan = subprocess.Popen([sys.executable, "-m", "astraflow", "plan", SIM, "--pool", "h100=1", "--gpus-per-node", "1",
                             "--minutes", "5", "--no-search", "--workdir", str(tmp_path)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pid_file, metrics = tmp_path / "sim0" / "run.pid", tmp_path / "sim0" / "run" / "metrics.jsonl"
        deadline = time.time() + 120
        while not (metrics.exists() and '"loss"' in metrics.read_text()):  # mid-simulation: steps are being taken
            assert plan.poll() is None and time.time() < deadline, "the simulated run did not start"
            time.sleep(0.5)
        child = psutil.Process(int(pid_file.read_text()))
        family = [child, *child.children(recursive=True)]  # the run and its cluster's workers
        plan.send_signal(signal.SIGTERM)
        assert plan.wait(timeout=100) != 0
        _, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, f"left running: {[p.pid for p in alive]}"
    finally:
        if plan.poll() is None:
            os.kill(plan.pid, signal.SIGKILL)
            plan.wait()
