"""The calculator example through the real CLI in a subprocess: multi-turn episodes with a tool
are rolled out, trained on and evaluated, with their episode statistics and per-difficulty
evaluation in metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_calculator_example_runs(tiny_model, tmp_path):
    data = yaml.safe_load((ROOT / "examples" / "calculator" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(tiny_model)
    data["policies"][0].pop("init")  # an untrained model: this checks the path, not learning
    data["run"].update(max_steps=2, timeout_s=100)
    data["workload"].update(group_size=4, eval={"every": 2, "num_prompts": 4})
    data["workload"]["params"].update(num_train=50, num_test=10)
    data["workload"]["sampling"]["max_new_tokens"] = 32
    data["dataflow"]["batch_size"] = 8
    data["rollout"]["capacity"] = 16
    cfg = tmp_path / "calculator.yaml"
    cfg.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "astraflow", "run", str(cfg), "--run-dir", str(run_dir), "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=150,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if "loss" in x]
    assert [x["step"] for x in train] == [1, 2]
    assert all(1 <= x["episode_turns"] <= 4 for x in train)
    evals = [x for x in lines if "eval_accuracy" in x]
    assert evals and all(set(x["eval_by_difficulty"]) <= {"1", "2"} for x in evals)
