"""Bad input to the real CLI, in a subprocess as a user meets it: exit code 2 and one line that
names the file or field and the fix, never a traceback. And configs that cannot learn by
construction are refused by `astraflow check`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from astraflow.cli import main
from tests.e2e.test_cli import _write_config

ROOT = Path(__file__).resolve().parents[2]
NO_GPU = not torch.cuda.is_available()


def _not_utf8(tmp_path, cfg):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(cfg.read_bytes() + "# caf\xe9\n".encode("latin-1"))
    return ["check", str(bad)]


def _a_list(tmp_path, cfg):
    (tmp_path / "list.yaml").write_text("- run\n- policies\n")
    return ["check", str(tmp_path / "list.yaml")]


def _a_scalar(tmp_path, cfg):
    (tmp_path / "scalar.yaml").write_text("just words\n")
    return ["check", str(tmp_path / "scalar.yaml")]


def _not_yaml(tmp_path, cfg):
    (tmp_path / "broken.yaml").write_text("run:\n  max_steps: [3\n")
    return ["check", str(tmp_path / "broken.yaml")]


def _run_dir_under_a_file(tmp_path, cfg):
    (tmp_path / "afile").write_text("")
    return ["run", str(cfg), "--run-dir", str(tmp_path / "afile" / "run")]


def _run_dir_in_a_read_only_dir(tmp_path, cfg):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    return ["run", str(cfg), "--run-dir", str(ro / "run")]


def _run_dir_in_sysfs(tmp_path, cfg):
    return ["run", str(cfg), "--run-dir", "/sys/astraflow-run"]


def _sets(*pairs):
    return lambda tmp_path, cfg: ["check", str(cfg), *[x for p in pairs for x in ("--set", p)]]


CASES = {
    "config not UTF-8": (_not_utf8, "not UTF-8 text", None),
    "YAML list, not a mapping": (_a_list, "the top level must be a mapping", None),
    "YAML scalar, not a mapping": (_a_scalar, "the top level must be a mapping", None),
    "not valid YAML: where, in one line": (_not_yaml, "broken.yaml: not valid YAML at line 3, column 1: ", None),
    "--run-dir under a file": (_run_dir_under_a_file, "cannot be created or written", None),
    "--run-dir in a read-only directory": (_run_dir_in_a_read_only_dir, "cannot be created or written",
                                           "root may write anywhere" if os.geteuid() == 0 else None),
    "--run-dir in sysfs": (_run_dir_in_sysfs, "cannot be created or written",
                           None if Path("/sys").is_dir() else "no /sys here"),
    "trainer device cuda without a GPU": (_sets("policies.solver.trainer.device=cuda"),
                                          "policies[solver].trainer.device: 'cuda' asked for",
                                          None if NO_GPU else "this machine has a GPU"),
    "engine device cuda:3 without a GPU": (_sets("rollout.engine.device=cuda:3"),
                                           "rollout.engine.device: 'cuda:3' asked for",
                                           None if NO_GPU else "this machine has a GPU"),
    "--set value not YAML": (_sets("run.max_steps=[1,"), "the value is not valid YAML", None),
    "--set without a key": (_sets("=3"), "is not a dotted key", None),
    "megatron TP not dividing the heads": (_sets("policies.solver.trainer.backend=megatron",
                                                 "policies.solver.trainer.tensor_parallel=3"),
                                           "tensor-parallel size 3 must divide num_attention_heads", None),
    "an empty model directory with init": (lambda tmp_path, cfg: (tmp_path / "empty").mkdir() or [
        "check", str(cfg), "--set", f"policies.solver.model={tmp_path / 'empty'}",
        "--set", "policies.solver.init={preset: tiny}"], "exists and is empty", None),
    "a train split without prompts": (lambda tmp_path, cfg: ["run", str(cfg), "--set", "workload.params.num_train=0",
                                                             "--run-dir", str(tmp_path / "run")],
                                      "has no training prompts", None),
}


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_exits_2_with_one_line_and_no_traceback(case, tiny_model, tmp_path):
    make, needle, skip = CASES[case]
    if skip:
        pytest.skip(skip)
    args = make(tmp_path, _write_config(tmp_path, tiny_model))
    proc = subprocess.run([sys.executable, "-m", "astraflow", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert len(errors) == 1 and errors[0].startswith("Error: ") and needle in errors[0], proc.stderr


@pytest.mark.parametrize("dataflow", [{}, {"group_filter": {"type": "drop_zero_advantage"}}])
def test_check_refuses_groups_of_one(tiny_model, tmp_path, dataflow):
    cfg = _write_config(tmp_path, tiny_model, workload={"group_size": 1}, dataflow=dataflow)
    res = CliRunner().invoke(main, ["check", str(cfg)])
    assert res.exit_code == 2, res.output
    assert "workload.group_size: 1 cannot train" in res.output and "workload.group_size: 2 or more" in res.output
    assert "Traceback" not in res.output
