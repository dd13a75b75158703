"""A run that fails after it started: the orchestrator still stops its workers and scheduler, and
the CLI ends with exit code 1 and the failure's one-line reason (a trainer's numerics stop
among them), not a traceback."""

from __future__ import annotations

import json

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
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"].startswith("trainer solver failed")


def test_an_unexpected_error_takes_the_same_way_out_with_its_traceback_in_the_log(tmp_path, monkeypatch):
    """An error that is not a named run failure (an actor call that raised, a bug) still writes
    the summary and tears down; the reason is one line, the traceback goes to the log."""
    orch = Orchestrator(tiny_config(tmp_path), tmp_path / "run")

    def fail():
        raise KeyError("solver")

    monkeypatch.setattr(orch, "_bring_up", fail)
    with pytest.raises(RunFailed, match=r"KeyError: 'solver' \(traceback in .*orchestrator.log\)") as err:
        orch.run()
    assert "\n" not in str(err.value)
    assert "Traceback" in (tmp_path / "run" / "logs" / "orchestrator.log").read_text()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"].startswith("KeyError: 'solver'")


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
