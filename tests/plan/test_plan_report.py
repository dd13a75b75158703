"""What a plan reports is what it simulated and used: the search's factors are those of the sizes
run, a search whose larger pools do not lower the wait stops and says why, the config's own sim
engine settings that no pool carries are named, a piped report is not cut, and a calibration
whose peak rate is below its single rate is refused naming the file. Simulated runs are stand-ins."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from rich.console import Console

from astraflow.cli import main
from astraflow.config import load_config
from astraflow.plan import planner
from astraflow.plan.planner import Calibration, PlanOptions, PlanReport, run_plan
from astraflow.plan.pools import PlanError, SimShape, parse_pool
from astraflow.plan.report import print_report
from astraflow.plan.search import SearchResult, Trial
from astraflow.plan.simulate import SimResult

ROOT = Path(__file__).resolve().parents[2]
SIM = str(ROOT / "examples/sim/config.yaml")


def _result(pools: dict[str, int], wait: float) -> SimResult:
    return SimResult(pools=pools, steps=8, steps_per_s=1.0, trajectories_per_s=1.0, tokens_per_s=1.0,
                     trained_per_s=1.0, trainer_wait=wait, staleness={"p50": 0, "p90": 0, "max": 0},
                     dropped={"stale": 0, "overflow": 0, "filtered": 0})


def _plan(monkeypatch, tmp_path, wait, pool="h100=4", sets=(), search=True):
    """``run_plan`` with each simulated run replaced by ``wait(gpus)``; the report and progress lines."""
    monkeypatch.setattr(planner, "run_sim", lambda data, wd, pools, scale, progress=None: _result(
        pools, wait(sum(pools.values()))))
    lines: list[str] = []
    report = run_plan(load_config(SIM, list(sets)), [parse_pool(pool, 8, None)],
                      PlanOptions(minutes=1, search=search, workdir=tmp_path), progress=lines.append)
    return report, lines


def test_search_trials_carry_the_factor_of_the_sizes_simulated(monkeypatch, tmp_path):
    report, lines = _plan(monkeypatch, tmp_path, lambda gpus: max(0.0, 1 - gpus / 20))
    trials = report.search.trials
    assert len(trials) > 1
    for t in trials:  # h100=4 scaled: up to 8 GPUs one node of that many, then whole nodes of 8
        assert t.factor == dict(t.sizes)["h100"] / 4
    assert report.search.factor == dict(report.search.sizes)["h100"] / 4
    tags = {ln.split(":")[0] for ln in lines if ln.startswith("search x")}
    assert tags == {f"search x{t.factor:.3g}" for t in trials if t.factor != 1.0}


def test_a_search_whose_larger_pools_do_not_lower_the_wait_stops_and_says_why(monkeypatch, tmp_path):
    report, _ = _plan(monkeypatch, tmp_path, lambda gpus: 0.9)  # a run limited by something else
    s = report.search
    assert len(s.trials) == 2 and s.limited and s.sizes is None
    console = Console(record=True, width=120)
    print_report(report, console)
    out = " ".join(console.export_text().split())
    assert "more GPUs did not lower the trainer wait" in out and "not what limits this run" in out


def test_sim_engine_settings_no_pool_carries_are_named_with_the_way_to_model_them(monkeypatch, tmp_path):
    _, lines = _plan(monkeypatch, tmp_path, lambda gpus: 0.0, sets=["rollout.engine.sim.peak_tokens_per_s=300"],
                     search=False)
    (warning,) = [ln for ln in lines if ln.startswith("warning")]
    assert "rollout.engine.sim.peak_tokens_per_s" in warning and "rollout.engine.sim.load_seconds" in warning
    assert "time_scale" not in warning and "length_mean" not in warning  # those the plan uses
    assert "--calibrate" in warning and "local" in warning


def test_a_piped_report_is_not_cut(monkeypatch):
    sizes = (("a100", 1024), ("cpu", 512), ("h100", 2048))
    shape = SimShape(step_seconds=2.5, prompt_tokens=64, response_mean=200.0, response_sigma=0.8, time_scale=1.25,
                     steps=240)
    result = _result(dict(sizes), 0.123456)
    result.per_pool = {k: {"share": 1 / 3, "trajectories_per_s": 123456.789, "tokens_per_s": 98765432.1}
                       for k, _ in sizes}
    result.dropped = {"stale": 1234567, "overflow": 7654321, "filtered": 1111111}
    result.dropped_fraction = {"stale": 0.1234, "overflow": 0.4321, "filtered": 0.0555}
    search = SearchResult(0.1, 1.0, sizes, [Trial(1.0, sizes, 0.05)])
    src = {"step_seconds": "--step-seconds", "prompt_tokens": "default", "response_tokens": "default",
           "time_scale": "auto"}
    monkeypatch.setattr(planner, "run_plan", lambda *a, **k: PlanReport(shape, src, result, search))
    res = CliRunner().invoke(main, ["plan", SIM, "--pool", "h100=8"])
    assert res.exit_code == 0, res.output
    assert "…" not in res.output
    for value in ("a100=1024 cpu=512 h100=2048", "1234567/7654321/1111111", "12.3%/43.2%/5.5%", "9.877e+07"):
        assert value in res.output


def test_a_calibration_whose_peak_rate_is_below_its_single_rate_is_refused_naming_file_and_field(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"engine": {"single_tokens_per_s": 50, "peak_tokens_per_s": 10, "ttft_s": 0.1,
                                           "prefill_tokens_per_s": 100, "max_batch": 4, "load_seconds": 1},
                                "step_seconds": 1, "prompt_tokens": 10, "response_mean": 5}))
    try:
        Calibration.load(path)
    except PlanError as err:
        assert str(path) in str(err) and "peak_tokens_per_s" in str(err) and "--calibrate" in str(err)
    else:
        raise AssertionError("a calibration with peak_tokens_per_s below single_tokens_per_s was accepted")
