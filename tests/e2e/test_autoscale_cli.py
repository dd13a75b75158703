"""The autoscaler end to end, through the real CLI, on simulated nodes with local workers
(examples/sim/autoscale.yaml): the sim trainer starts slow, speeds up (it waits for rollouts: a
rollout worker is added, which then generates) and slows down (data is always ready: a worker
is drained); each change is recorded with its reason and signals, shown by ``astraflow status
--json``, and the per-partition view adds up.

Pacing: after the speed-up the trainer needs a batch every 0.05 s, far more than a node makes;
after the slow-down (3 s a step) one node makes several batches per step. ``max_steps`` leaves
the slow phase long enough for the drain on a loaded machine (the test says so if it is not)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from astraflow.cli import main
from astraflow.runtime.monitoring import StatusView

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def autoscaled_run(tmp_path_factory):
    """examples/sim/autoscale.yaml run once through the CLI: (run directory, its output)."""
    tmp = tmp_path_factory.mktemp("autoscale")
    data = yaml.safe_load((ROOT / "examples/sim/autoscale.yaml").read_text())
    assert data["policies"][0]["trainer"]["sim_step_schedule"] == {2: 0.05, 8: 3.0}
    assert data["autoscale"]["memory_s"] < 3.0 * (data["run"]["max_steps"] - 8)  # the drain's room in the slow phase
    data["run"].update(timeout_s=200)
    cfg = tmp / "config.yaml"
    cfg.write_text(yaml.safe_dump(data))
    run_dir = tmp / "run"
    proc = subprocess.run([sys.executable, "-m", "astraflow", "run", str(cfg), "--run-dir", str(run_dir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=220)
    out = proc.stdout[-4000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    return run_dir, proc.stdout, out


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_trainer_that_speeds_up_gets_a_node_and_one_that_slows_down_loses_it(autoscaled_run):
    run_dir, stdout, out = autoscaled_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == {"solver": 22}

    changes = [json.loads(x) for x in (run_dir / "control" / "autoscale.jsonl").read_text().splitlines()]
    actions = [(c["action"], c["partition"], c["desired"], c["target"]) for c in changes]
    assert actions[:1] == [("add", "rollout", 1, 2)], out
    assert ("drain", "rollout", 2, 1) in actions, f"no drain before the run ended: {actions}\n{out}"
    assert actions.index(("drain", "rollout", 2, 1)) > 0
    add = changes[0]
    drain = changes[actions.index(("drain", "rollout", 2, 1))]
    assert add["signals"]["trainer_wait"] > 0.3 and "> high_wait 30%" in add["reason"]
    assert drain["signals"]["trainer_wait"] < 0.1 and "< low_wait 10%" in drain["reason"]
    assert all(c["signals"]["evidence_s"] >= 3.0 for c in changes)  # a full window behind each
    assert all(1 <= c["target"] <= 2 for c in changes)
    assert "autoscale: trainer wait" in stdout  # noted in the run's output

    # the added worker served and generated, then was drained (not killed)
    workers = summary["workers"]
    added = workers["rollout-rollout-local-cpu-1"]
    assert added["served"] and added["gone"] and added["note"] == "drained", added
    nodes = summary["data_layer"]["nodes"]
    assert nodes["rollout-rollout-local-cpu-1"]["completed"] > 0
    assert summary["partitions"]["rollout"]["nodes"] == 1 and summary["partitions"]["rollout"]["live"] == 1

    res = CliRunner().invoke(main, ["status", str(run_dir), "--json"])
    assert res.exit_code == 0, res.output
    view = StatusView.model_validate_json(res.output)
    assert [(c.action, c.target) for c in view.autoscale.changes] == [(c["action"], c["target"]) for c in changes]
    assert view.autoscale.high_wait == 0.3 and view.autoscale.window_s == 3.0
    rollout = next(p for p in view.partitions if p.name == "rollout")
    assert rollout.autoscale is not None and (rollout.autoscale.min_nodes, rollout.autoscale.max_nodes) == (1, 2)
    assert rollout.desired == 1
    # per-partition view: what its nodes made and the trainer consumed, at most max_staleness old
    pol = view.policies[0]
    assert rollout.consumed == pol.consumed > 0
    assert rollout.staleness_max is not None and rollout.staleness_max <= 2
    assert 0 <= rollout.staleness_mean <= rollout.staleness_max
    assert rollout.versions["solver"] and max(rollout.versions["solver"]) <= 22
    trainer_part = next(p for p in view.partitions if p.name == "trainer")
    assert trainer_part.consumed == 0 and trainer_part.autoscale is None


@pytest.mark.e2e
@pytest.mark.browser
@pytest.mark.timeout(240)
def test_the_dashboard_page_shows_the_decisions_and_the_partition_view(autoscaled_run, tmp_path):
    from astraflow.runtime.cluster import SchedulerProcess
    from astraflow.runtime.security import client_security, run_tls
    from schedulers.tls import TLSConfig
    from storage.paths import RunPaths
    from tests.monitoring.test_monitoring import _driver

    run_dir, _, _ = autoscaled_run
    driver = _driver(tmp_path)  # skips without chromium and selenium
    paths = RunPaths(run_dir)
    files = run_tls(paths, TLSConfig())
    proc = SchedulerProcess(paths, "127.0.0.1", 0, tls=files)
    try:
        from distributed import Client

        with Client(proc.start(), timeout=20, security=client_security(files)) as client:
            port = client.scheduler_info()["services"]["dashboard"]
        driver.get(f"http://127.0.0.1:{port}/astraflow?refresh=300")

        def js(expr: str):
            return driver.execute_script(expr)

        deadline = time.time() + 60
        while time.time() < deadline and not js("return document.querySelectorAll('#autoscale tbody tr').length"):
            time.sleep(0.3)
        rows = js("return [...document.querySelectorAll('#autoscale tbody tr')].map(r => r.textContent)")
        assert len(rows) >= 2 and "drain" in rows[0] and "2 → 1" in rows[0] and "add" in rows[-1], rows
        assert not js("return document.getElementById('autoscale-section').hidden")
        head = js("return document.getElementById('partition-rollout').textContent")
        assert "traj/s" in head and "staleness mean" in head and "serving solver:v" in head, head
        assert "autoscale 1–2 nodes" in head, head
        assert "/node" in head and "engine(s) × batch" in head, head  # the partition's capacity
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE" and e["source"] != "network"]
        assert not errors, errors
    finally:
        driver.quit()
        proc.stop()
