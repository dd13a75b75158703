"""The chaos run in CI size, through the real CLI: one kill of each kind (a RaaS node's worker,
its engine process, the trainer's worker, the data layer's worker, and the ``astraflow run``
process followed by the user's resume on the same run directory), by the benchmark's own
killer (``benchmarks/chaos_killer.py``) and judged by its audit (``benchmarks/chaos_audit.py``):
nothing lost, nothing trained twice, every task ended once, steps contiguous, the run completes,
no part fails on its own in the aftermath of a kill, and no process of the run is left behind."""

from __future__ import annotations

import pytest
import yaml

from benchmarks.chaos_audit import audit_run
from benchmarks.chaos_killer import KINDS, CliRun, Killer, alive
from tests.e2e.test_cli import _write_config
from tests.slurm.slow_workflow import PACE_OFF_ENV, end_pacing

STEPS = 40


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_one_kill_of_each_kind_loses_nothing_and_the_run_completes(tiny_model, tmp_path, monkeypatch):
    # both incarnations inherit the switch that ends the pacing once the last kill is recovered
    monkeypatch.setenv(PACE_OFF_ENV, str(tmp_path / "pace-off"))
    cfg = _write_config(tmp_path, tiny_model)
    data = yaml.safe_load(cfg.read_text())
    # one RaaS node: fewer processes on a small machine; its crash-loop budget allows one kill
    data["partitions"] = [{"name": n, "scheduler": "local", "role": n, "nodes": 1} for n in ("data", "trainer", "rollout")]
    cfg.write_text(yaml.safe_dump(data))
    run = CliRun(cfg, tmp_path / "run", [
        f"run.max_steps={STEPS}", "workload.eval.every=20",
        # paced (each episode takes >= 0.5 s): the kills land while it trains, on any machine
        "workload.workflow=tests.slurm.slow_workflow:slow_single_turn_test",
        "cluster.trainer_restarts=5", "cluster.data_layer_restarts=5", "rollout.engine_restarts=5",
        "rollout.engine.process=true"],  # an engine process to kill (the tiny example runs none)
        tmp_path / "run.log")
    run.start()
    lines: list[str] = []
    killer = Killer(run, kills=len(KINDS), seed=1, mean_gap_s=1.0, recovery_timeout_s=150, say=lines.append)
    try:
        kills = killer.run_all()
        end_pacing(tmp_path / "pace-off")  # the kills are done: the remaining steps need no pacing
        rc = run.wait(240)
    finally:
        left = run.stop()
    print("\n".join(lines))  # the kills and how long each part took to come back (pytest -s)
    log = "\n".join(lines) + "\n" + run.log.read_text()[-4000:]
    assert sorted(k.kind for k in kills) == sorted(KINDS), log
    assert all(k.recovered for k in kills), log
    assert not killer.unplanned_losses(), log  # no part failed on its own after a kill (a hung call, say)
    assert rc == 0, log
    assert killer.orphans == {"workers": 0, "engines": 0}, log  # the killed incarnation's processes died with it
    audit = audit_run(tmp_path / "run")
    assert audit["ok"], (audit["problems"], log)
    assert audit["lost_trajectories"] == 0 and audit["duplicated_trainings"] == 0
    assert audit["never_ended"] == 0 and audit["ended_twice"] == 0 and audit["created_twice"] == 0
    assert audit["final_step"] == STEPS and audit["status"] == "completed"
    assert len(run.incarnations) == 2
    assert not left and not [i for i in run.seen if alive(i)], "processes of the run were left running"
