"""The code example through the real CLI in a subprocess, shrunk to two steps on the untrained
test model (this checks the path, not learning): completions run in the sandbox, the steps'
records carry the programs' outcomes (``episode_code_*``), and the first and last evaluations
report HumanEval as a second set, every problem run without a sandbox error. Needs bubblewrap:
skipped without it unless ASTRAFLOW_REQUIRE_SANDBOX=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from astraflow.sandbox import Sandbox, SandboxConfig, SandboxUnavailable

ROOT = Path(__file__).resolve().parents[2]


def need_sandbox() -> None:
    try:
        Sandbox(SandboxConfig()).check()
    except SandboxUnavailable as err:
        if os.environ.get("ASTRAFLOW_REQUIRE_SANDBOX") == "1":
            raise
        pytest.skip(f"no working sandbox here: {err}")


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_code_example_runs(tiny_model, tmp_path):
    need_sandbox()
    data = yaml.safe_load((ROOT / "examples/code/config.yaml").read_text())
    data["policies"][0]["model"] = str(tiny_model)
    data["policies"][0].pop("init", None)
    data["run"].update(max_steps=2, timeout_s=200)
    data["workload"].update(group_size=4, eval={"every": 2, "num_prompts": 6})
    data["workload"]["params"].update(humaneval=3, num_test=6)
    data["workload"]["sampling"]["max_new_tokens"] = 8
    data["dataflow"]["batch_size"] = 8
    data["rollout"]["capacity"] = 16
    data["cluster"] = {"dashboard_port": 0}
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "astraflow", "run", str(cfg), "--run-dir", str(run_dir), "--quiet"],
                          cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if "loss" in x]
    assert [x["step"] for x in train] == [1, 2]
    stats = [x for x in train if "episode_code_pass" in x]
    assert stats and all("episode_code_timeout" in x for x in stats)
    evals = [x for x in lines if "eval_accuracy" in x]
    assert [x["step"] for x in evals] == [0, 2]
    for x in evals:
        assert x["eval_prompts"] == 6 and "eval_code_timeout" in x
        he = x["eval_sets"]["humaneval"]
        assert he["prompts"] == 3 and "code_timeout" in he and 0.0 <= he["pass@1"] <= 1.0


def test_without_a_working_sandbox_the_run_exits_2_before_anything_starts(tmp_path):
    """A code run on a machine where bubblewrap is missing: one line naming the fix, at once,
    no run directory (not every episode failing until a deadline)."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "astraflow", "run", str(ROOT / "examples/code/config.yaml"), "--run-dir", str(run_dir),
         "--set", "sandbox.bwrap=/nonexistent/bwrap", "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and "sandbox: bubblewrap (/nonexistent/bwrap) not found" in lines[0], lines
    assert "apt-get install -y bubblewrap" in lines[0] and not run_dir.exists()
