"""The real CLI, as a user runs it: in a subprocess, with a deadline; and its bad-input paths
through click's runner (exit code 2, one message naming the fix, no traceback)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from astraflow.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _write_config(tmp_path, model, **changes) -> Path:
    data = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(model)
    data["policies"][0].pop("init", None)
    for section, values in changes.items():
        data.setdefault(section, {}).update(values)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_run_subprocess_writes_expected_records(tiny_model, tmp_path):
    cfg = _write_config(tmp_path, tiny_model)
    run_dir = tmp_path / "run"
    proc = subprocess.run(  # with the default engine, in a process of its own (the tiny example's runs in the node)
        [sys.executable, "-m", "astraflow", "run", str(cfg), "--run-dir", str(run_dir),
         "--set", "run.max_steps=3", "--set", "rollout.engine.process=true"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dashboard http://127.0.0.1:" in proc.stdout
    assert f"the trained model as an HF directory: astraflow export {run_dir} OUT" in proc.stdout
    assert f"what the policies wrote, episode by episode: astraflow episodes {run_dir}" in proc.stdout
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if "loss" in x]
    assert [x["step"] for x in train] == [1, 2, 3]
    for x in lines:
        assert {"step", "policy", "time"} <= set(x)
    evals = [x for x in lines if "eval_accuracy" in x]
    assert [x["step"] for x in evals] == [0, 2, 3]
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["run"]["max_steps"] == 3
    assert (run_dir / "summary.json").exists() and (run_dir / "logs" / "scheduler.log").exists()
    # what the policy wrote: single-turn episodes decoded from their stored tokens
    res = CliRunner().invoke(main, ["episodes", str(run_dir), "--json", "-n", "3", "--kind", "train"])
    assert res.exit_code == 0, res.output
    shown = json.loads(res.output)["recent"]
    assert len(shown) == 3 and all(e["kind"] == "train" and not e["turns"] for e in shown)
    for e in shown:  # the tiny config: 1-digit sums, a completion of up to 4 tokens
        assert re.fullmatch(r"\d[-+]\d=", e["prompt"]) and e["completion"], e
    res = CliRunner().invoke(main, ["episodes", str(run_dir), "-n", "2", "--min-reward", "2"])
    assert res.exit_code == 2 and "none matches the filters" in res.output
    # the trained policy leaves the run as an HF directory transformers loads
    proc = subprocess.run([sys.executable, "-m", "astraflow", "export", str(run_dir), str(tmp_path / "trained")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "exported solver v3 (train step 3)" in proc.stdout, proc.stdout + proc.stderr
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path / "trained").num_parameters() > 0


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"run": {"max_stepz": 3}}, "run.max_stepz: unknown key"),
        ({"run": {"max_steps": "many"}}, "run.max_steps: Input should be a valid integer"),
        ({"dataflow": {"batch_size": 10}}, "must be a multiple of workload.group_size"),
    ],
)
def test_bad_config_exits_2_with_one_message(tiny_model, tmp_path, change, needle):
    cfg = _write_config(tmp_path, tiny_model, **change)
    res = CliRunner().invoke(main, ["run", str(cfg), "--run-dir", str(tmp_path / "r")])
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert "Traceback" not in res.output


def test_missing_model_names_the_fix(tmp_path):
    data = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    data["policies"][0]["model"] = str(tmp_path / "nope")
    data["policies"][0].pop("init")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(main, ["check", str(tmp_path / "c.yaml")])
    assert res.exit_code == 2 and "add an `init:` section" in res.output and str(tmp_path / "nope") in res.output
    assert "nothing is downloaded at run time" in res.output


def test_set_override_and_bad_override(tiny_model, tmp_path):
    cfg = _write_config(tmp_path, tiny_model)
    res = CliRunner().invoke(main, ["check", str(cfg), "--set", "policies.solver.trainer.lr=0.01"])
    assert res.exit_code == 0 and "lr: 0.01" in res.output
    res = CliRunner().invoke(main, ["check", str(cfg), "--set", "run.max_steps"])
    assert res.exit_code == 2 and "use KEY=VALUE" in res.output
    res = CliRunner().invoke(main, ["check", str(tmp_path / "absent.yaml")])
    assert res.exit_code == 2 and "not found" in res.output


def test_every_shipped_config_parses(tmp_path):
    """Every YAML file under examples/ (``mix.yaml``, ``many_nodes.yaml`` too, not only ``config*``);
    examples/real needs a model fetched beforehand and is checked in tests/e2e/test_dataset_cli.py."""
    from astraflow.config import load_config

    configs = sorted(p for p in (ROOT / "examples").glob("*/*.yaml") if p.parent.name != "real")
    assert {"mix.yaml", "many_nodes.yaml", "autoscale.yaml"} <= {p.name for p in configs}
    for path in configs:
        load_config(path)


def test_help_explains():
    res = CliRunner().invoke(main, ["run", "--help"])
    assert res.exit_code == 0 and "--run-dir" in res.output and "--set" in res.output


def test_status_of_a_run_that_is_not_running(tmp_path):
    res = CliRunner().invoke(main, ["status", str(tmp_path)])
    assert res.exit_code == 2 and "no run has started" in res.output


def test_episodes_of_a_directory_that_is_no_run_or_keeps_no_store(tmp_path):
    res = CliRunner().invoke(main, ["episodes", str(tmp_path)])
    assert res.exit_code == 2 and "is not a run directory (no config.yaml)" in res.output
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"storage": {"trajectories": "memory://x"},
                                                          "workload": {"name": "math"}}))
    res = CliRunner().invoke(main, ["episodes", str(tmp_path)])
    assert res.exit_code == 2 and "lives inside the run's processes" in res.output
    res = CliRunner().invoke(main, ["episodes", str(tmp_path), "--min-reward", "2", "--max-reward", "1"])
    assert res.exit_code == 2 and "min_reward 2.0 is above max_reward 1.0" in res.output


@pytest.mark.parametrize("content, said", [(b": : bad\n", "ParserError"), (b"- a\n", "a YAML list, not a mapping"),
                                           (b"\xff\xfe", "UnicodeDecodeError")])
def test_episodes_of_a_run_whose_config_is_damaged_names_the_file(tmp_path, content, said):
    (tmp_path / "config.yaml").write_bytes(content)
    res = CliRunner().invoke(main, ["episodes", str(tmp_path)])
    assert res.exit_code == 2 and f"{tmp_path / 'config.yaml'} is not the config a run writes ({said}" in res.output, \
        res.output


@pytest.mark.parametrize("option", ["--min-reward", "--max-reward"])
def test_episodes_names_the_reward_bound_that_is_not_finite(tmp_path, option):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"workload": {"name": "math"}}))
    res = CliRunner().invoke(main, ["episodes", str(tmp_path), option, "nan"])
    assert res.exit_code == 2 and f"{option} nan: use a finite number" in res.output, res.output
