"""Calibration of a ``local`` pool on a real (tiny) model: the engine's rates and the trainer's
step are measured and positive, a saved calibration reads back the same, and a local pool built
from it turns the config into a valid simulated run that keeps the config's capacity."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.config import RunConfig, load_config
from astraflow.plan.calibrate import calibrate
from astraflow.plan.planner import Calibration, PlanOptions, shape_for
from astraflow.plan.pools import parse_pool, sim_config
from tests.e2e.test_cli import _write_config


@pytest.mark.timeout(240)
def test_calibration_measures_a_local_pool(tiny_model, tmp_path):
    cfg = load_config(_write_config(tmp_path, tiny_model, rollout={"capacity": 16, "engine": {"max_batch": 8}}))
    notes: list[str] = []
    cal = calibrate(cfg, progress=notes.append, repeats=1)
    p = cal.engine
    assert cal.step_seconds > 0 and p.ttft_s > 0 and p.max_batch == 8
    assert p.peak_tokens_per_s >= p.single_tokens_per_s >= p.peak_tokens_per_s / 8
    assert 1 <= cal.response_mean <= 4 and cal.prompt_tokens > 0  # max_new_tokens 4
    assert any("a step" in n for n in notes)
    path = tmp_path / "cal.json"
    cal.save(path)
    assert Calibration.load(path) == cal

    shape, sources = shape_for(cfg, PlanOptions(minutes=0.1, calibration=cal))
    assert sources["step_seconds"] == "calibration" and shape.step_seconds == cal.step_seconds
    data = sim_config(cfg, [parse_pool("local=1", 8, cal.engine)], shape)
    sim = RunConfig.model_validate(data)
    local = next(x for x in sim.partitions if x.name == "pool_local")
    assert local.rollout["capacity"] == 16 and local.rollout["engine"]["replicas"] == 1
    assert local.rollout["engine"]["sim"]["single_tokens_per_s"] == p.single_tokens_per_s
    assert all(pol.trainer.backend == "sim" and Path(str(pol.model)).name == "sim" for pol in sim.policies)
