"""Calibration of a ``local`` pool on a real (tiny) model: the engine's rates and the trainer's
step are measured and positive, a saved calibration reads back the same, and a local pool built
from it turns the config into a valid simulated run that keeps the config's capacity."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from astraflow.config import RunConfig, load_config
from astraflow.plan.calibrate import _batch_items, _group_payloads, _reward, calibrate
from astraflow.rollout.engine import Generation
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
    assert any("a step" in n for n in notes) and any("scored alike" in n for n in notes)
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


def test_the_trainer_batch_is_grpo_groups_with_their_rewards():
    """Groups of one task each; a group that scored alike has advantage 0 (a run's step skips
    it), the others their group-normalised advantages."""
    tasks = [{"q": i} for i in range(50)]
    payloads = _group_payloads(tasks, 8, 4, seed=0)
    assert payloads[:4] == [payloads[0]] * 4 and payloads[4:] == [payloads[4]] * 4
    gens = [Generation(tokens=np.array([5, 6], np.int32), logprobs=np.array([-1.0, -1.0], np.float32),
                       versions=np.zeros(2, np.int32), finish_reason="length") for _ in payloads]
    rewards = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    items = _batch_items([[1, 2, 3]] * 8, gens, rewards, n=16, group_size=4)
    assert len(items) == 16  # the batch repeats the generated groups
    assert [it.advantage for it in items[:4]] == [0.0] * 4
    adv = [it.advantage for it in items[4:8]]
    assert adv[0] > 0 > adv[1] and sum(adv) == pytest.approx(0.0, abs=1e-5)
    assert items[8].sequence is items[0].sequence and items[8].group_mean == 1.0


def test_a_group_scored_alike_at_a_fraction_has_advantage_exactly_0_as_in_a_run():
    """The data layer's group statistics: ``np.mean`` of equal fractions is not the fraction,
    so computed naively the rows would get a tiny advantage and be trained, not skipped."""
    gens = [Generation(tokens=np.array([5], np.int32), logprobs=np.array([-1.0], np.float32),
                       versions=np.zeros(1, np.int32), finish_reason="length") for _ in range(3)]
    items = _batch_items([[1, 2]] * 3, gens, [0.1, 0.1, 0.1], n=3, group_size=3)
    assert [it.advantage for it in items] == [0.0] * 3 and items[0].group_std == 0.0


def test_a_program_the_sandbox_failed_to_run_scores_0_in_a_calibration(monkeypatch):
    """The code workload fails such an episode (``SandboxFailed``) for a run to roll it out again;
    the calibration, which only groups rewards, goes on instead of ending after its generations."""
    from astraflow.workloads import code as code_mod

    class Failed:
        status, passed, total, all_passed, stderr = "sandbox_error", 0, 0, False, "sandbox could not start: no room"

    class Sandbox:
        def run(self, program, tests, timeout_s=None):
            return Failed()

    monkeypatch.setattr("astraflow.sandbox.default_sandbox", lambda: Sandbox())
    w = code_mod.CodeWorkload(num_train=1)
    task = w.tasks("train")[0]
    with pytest.raises(code_mod.SandboxFailed):
        w.reward("    return 0\n", task)
    assert _reward(w, "    return 0\n", task) == 0.0
