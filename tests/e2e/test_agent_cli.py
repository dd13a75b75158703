"""Every agentic example through the real CLI in a subprocess, shrunk to two steps on the
untrained test model (this checks the path, not learning): multi-turn episodes are rolled out,
trained on and evaluated, metrics.jsonl has their statistics and the per-difficulty evaluation,
and the episode viewer reads them back turn by turn from the trajectory store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from astraflow.cli import main
from astraflow.runtime.monitoring.episodes import EpisodeQuery, EpisodeReader

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "examples").glob("*/config.yaml")
                  if yaml.safe_load(p.read_text())["workload"].get("workflow") == "agent")


def test_the_agentic_examples_are_found():
    assert {"examples/calculator/config.yaml", "examples/custom_env/config.yaml",
            "examples/search/config.yaml", "examples/textworld/config.yaml"} <= set(EXAMPLES)


@pytest.mark.e2e
@pytest.mark.timeout(200)
@pytest.mark.parametrize("example", EXAMPLES)
def test_agentic_example_runs(example, tiny_model, tmp_path):
    data = yaml.safe_load((ROOT / example).read_text())
    data["policies"][0]["model"] = str(tiny_model)
    data["policies"][0].pop("init", None)
    data["run"].update(max_steps=2, timeout_s=150)
    data["workload"].update(group_size=4, eval={"every": 2, "num_prompts": 6})
    data["workload"].setdefault("params", {}).update(num_test=6)
    data["dataflow"]["batch_size"] = 8
    data.setdefault("rollout", {})["capacity"] = 16
    data["cluster"] = {"dashboard_port": 0}
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "astraflow", "run", str(cfg), "--run-dir", str(run_dir), "--quiet"],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if "loss" in x]
    assert [x["step"] for x in train] == [1, 2]
    # episode statistics cover the episodes since the previous step (a step may have none new)
    stats = [x for x in train if "episode_turns" in x]
    assert stats and all(x["episode_turns"] >= 1 and 0 <= x["episode_invalid_call_rate"] <= 1 for x in stats)
    evals = [x for x in lines if "eval_accuracy" in x]
    assert [x["step"] for x in evals] == [0, 2]
    assert all(x["eval_turns"] >= 1 and x["eval_by_difficulty"] for x in evals)
    view = EpisodeReader(run_dir).view(EpisodeQuery(limit=5, sample=0))
    assert view.recent and all(e.workflow == "agent" and e.turns for e in view.recent)
    assert {t.kind for e in view.recent for t in e.turns} >= {"observation", "model"}
    # the same episodes in a terminal: the task, then turn by turn
    res = CliRunner().invoke(main, ["episodes", str(run_dir), "-n", "1", "--kind", "train"])
    assert res.exit_code == 0, res.output
    assert "task: {" in res.output and "model (v" in res.output, res.output
    assert f"policies {data['policies'][0]['name']}" in res.output
