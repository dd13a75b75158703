"""The solver + test-generator example through the real CLI, in a subprocess with a deadline,
shrunk to two steps per policy on the untrained test model (this checks the path, not
learning): both policies train asynchronously from shared episodes, every candidate and suite
runs in the real sandbox, and the rewards and episode statistics are in range. Needs
bubblewrap: skipped without it unless ASTRAFLOW_REQUIRE_SANDBOX=1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.test_code_cli import need_sandbox

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.timeout(260)
def test_solver_and_tester_train_together(tiny_model, tmp_path):
    need_sandbox()
    data = yaml.safe_load((ROOT / "examples/code/config_testgen.yaml").read_text())
    for pol in data["policies"]:
        pol["model"] = str(tiny_model)
        pol.pop("init", None)
    data["run"].update(max_steps=2, timeout_s=200)
    data["workload"].update(group_size=4, eval={"every": 2, "num_prompts": 6})
    data["workload"]["params"].update(num_test=6, families=["add", "first"])
    data["workload"]["sampling"]["max_new_tokens"] = 8
    data["dataflow"]["batch_size"] = 8
    data["rollout"]["capacity"] = 16
    data["partitions"] = [{"name": "data", "scheduler": "local", "role": "data", "nodes": 1},
                          {"name": "trainer", "scheduler": "local", "role": "trainer", "nodes": 1},
                          {"name": "rollout", "scheduler": "local", "role": "rollout", "nodes": 1}]
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "astraflow", "run", str(cfg), "--run-dir", str(run_dir), "--quiet"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for pol in ("solver", "tester"):
        steps = [x for x in lines if x.get("policy") == pol and "loss" in x]
        assert [x["step"] for x in steps] == [1, 2], pol
        assert all(0.0 <= x["reward_mean"] <= 1.0 for x in steps), pol
    stats = [x for x in lines if "loss" in x and "episode_tester_reward" in x]
    assert stats
    for x in stats:
        assert 0.0 <= x["episode_tester_reward"] <= 1.0 and 0.0 <= x["episode_solver_pass"] <= 1.0
        assert x["episode_tester_unjudged"] == 0.0  # no sandbox error
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == {"solver": 2, "tester": 2}
    evals = [x for x in lines if "eval_accuracy" in x]
    assert evals and all(0.0 <= x["eval_accuracy"] <= 1.0 and 0.0 <= x["eval_tester_reward"] <= 1.0 for x in evals)
