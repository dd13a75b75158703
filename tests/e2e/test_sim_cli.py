"""The simulated example through the real CLI: no model anywhere, yet the whole control plane
runs (leases, data layer, ledger, trajectory store, trainer, weight versions): the run exits 0,
versions are published, trajectories stored and tagged with the versions that made them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from storage.trajectories import open_trajectory_store
from storage.trajectories.layout import EntryRef
from storage.weights import WeightStore

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_sim_example_runs(tmp_path):
    data = yaml.safe_load((ROOT / "examples/sim/config.yaml").read_text())
    data["run"].update(max_steps=6, timeout_s=150)
    data["workload"]["eval"] = {"every": 6, "num_prompts": 20}
    data["workload"]["params"]["num_test"] = 20
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "astraflow", "run", str(cfg), "--run-dir", str(run_dir), "--quiet"],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == {"solver": 6}
    assert WeightStore(run_dir / "weights").latest("solver").version == 6
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == [1, 2, 3, 4, 5, 6]
    assert [x["step"] for x in lines if "eval_accuracy" in x] == [0, 6]
    store = open_trajectory_store(str(run_dir / "trajectories"), "r")
    counts = {seg: store.count(seg) for seg in store.segments()}
    assert len(counts) == 2 and sum(counts.values()) >= 6 * 32
    rows = store.read([EntryRef(seg, i) for seg, n in counts.items() for i in range(n)])
    assert all(r.loss_mask.sum() > 0 for r in rows)
    versions = {int(v) for r in rows for v in r.versions if v >= 0}
    assert max(versions) >= 1  # tokens made by versions the trainer published
