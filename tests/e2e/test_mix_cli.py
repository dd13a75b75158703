"""The mix example through the real CLI in a subprocess: both sources are rolled out, every
batch holds them 3:1, and the evaluation reports accuracy per source."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_mix_example_runs_and_reports_sources(tiny_model, tmp_path):
    data = yaml.safe_load((ROOT / "examples" / "math" / "mix.yaml").read_text())
    data["policies"][0]["model"] = str(tiny_model)
    data["policies"][0].pop("init")
    cfg = tmp_path / "mix.yaml"
    cfg.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "astraflow", "run", str(cfg), "--run-dir", str(run_dir),
         "--set", "run.max_steps=2", "--set", "workload.eval.num_prompts=4"],
        cwd=ROOT, capture_output=True, text=True, timeout=200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if "loss" in x]
    assert [x["step"] for x in train] == [1, 2]
    for x in train:
        assert x["data_consumed_by_source"] == {"add2": 12, "mul1": 4}
    assert train[-1]["consumed_by_source"] == {"add2": 24, "mul1": 8}
    evals = [x for x in lines if "eval_accuracy" in x]
    assert evals and all(set(x["eval_accuracy_by_source"]) == {"add2", "mul1"} for x in evals)
