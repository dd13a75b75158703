"""Two policies (solver + verifier) through the real CLI, as a user runs it: in a subprocess,
with a deadline, in AstraFlow's asynchronous mode and in the trainer-centred ``sync`` mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _two_policy_config(tmp_path: Path, model: Path, mode: str) -> Path:
    data = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    solver = data["policies"][0]
    solver.pop("init", None)
    solver["model"] = str(model)
    data["policies"] = [solver, {"name": "verifier", "model": str(model)}]
    data["run"].update(max_steps=2, mode=mode, timeout_s=150)
    data["workload"]["workflow"] = "solver_verifier"
    data["workload"]["eval"] = {"every": 2, "num_prompts": 8}
    data["partitions"] = [
        {"name": "data", "scheduler": "local", "role": "data", "nodes": 1},
        {"name": "trainer", "scheduler": "local", "role": "trainer", "nodes": 1},
        {"name": "rollout", "scheduler": "local", "role": "rollout", "nodes": 1},
    ]
    path = tmp_path / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _run(cfg: Path, run_dir: Path) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "astraflow", "run", str(cfg), "--run-dir", str(run_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_both_policies_trained(lines: list[dict]) -> None:
    for pol in ("solver", "verifier"):
        steps = [x["step"] for x in lines if x.get("policy") == pol and "loss" in x]
        assert steps == [1, 2], (pol, steps)
    evals = [x for x in lines if "eval_accuracy" in x]
    assert evals and evals[-1]["step"] == 2
    assert all(0.0 <= x["eval_accuracy"] <= 1.0 for x in evals)


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_two_policy_async_run(tiny_model, tmp_path):
    run_dir = tmp_path / "async"
    lines = _run(_two_policy_config(tmp_path, tiny_model, "async"), run_dir)
    _check_both_policies_trained(lines)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == {"solver": 2, "verifier": 2}
    assert summary["iterations"] == []  # no driver loop in async mode


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_two_policy_sync_baseline_run(tiny_model, tmp_path):
    run_dir = tmp_path / "sync"
    lines = _run(_two_policy_config(tmp_path, tiny_model, "sync"), run_dir)
    _check_both_policies_trained(lines)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == {"solver": 2, "verifier": 2}
    its = summary["iterations"]
    assert [it["step"] for it in its] == [1, 2]
    for it in its:
        assert min(it["rollout_s"], it["train_s"], it["sync_s"]) >= 0
        assert it["iteration_s"] == pytest.approx(it["rollout_s"] + it["train_s"] + it["sync_s"], abs=1e-6)
