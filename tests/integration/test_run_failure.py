"""A run that fails after it started: the orchestrator still stops its workers and scheduler, and
the CLI ends with exit code 1 and the failure's one-line reason (a trainer's numerics stop
among them), not a traceback."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import astraflow.runtime.launch as launch_mod
from astraflow.cli import main
from astraflow.runtime.orchestrator import Orchestrator, RunFailed
from astraflow.training.numerics import NonFiniteError
from tests.conftest import tiny_config
from tests.e2e.test_cli import _write_config


def test_a_failed_run_still_tears_down(tmp_path, monkeypatch):
    orch = Orchestrator(tiny_config(tmp_path), tmp_path / "run")
    torn_down = []

    def fail():
        raise RunFailed("trainer solver failed: NonFiniteError: ...")

    monkeypatch.setattr(orch, "_bring_up", fail)
    monkeypatch.setattr(orch, "_teardown", lambda: torn_down.append(True))
    with pytest.raises(RunFailed):
        orch.run()
    assert torn_down == [True]


@pytest.mark.parametrize("error", [
    RunFailed("trainer solver failed: NonFiniteError: trainer solver: 3 steps in a row had a loss or gradient "
              "norm that is not finite; likely cause: a learning rate too high (lower policies[solver].trainer.lr)"),
    NonFiniteError("trainer solver: 3 steps in a row ...; likely cause: ... policies[solver].trainer.lr"),
])
def test_the_cli_reports_a_failed_run_in_one_line(tiny_model, tmp_path, monkeypatch, error):
    def launch(cfg, run_dir, quiet=False):
        raise error

    monkeypatch.setattr(launch_mod, "launch", launch)
    res = CliRunner().invoke(main, ["run", str(_write_config(tmp_path, tiny_model)), "--run-dir", str(tmp_path / "r")])
    assert res.exit_code == 1, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert lines == [f"Error: the run failed: {error}"]
    assert "policies[solver].trainer.lr" in lines[0]
