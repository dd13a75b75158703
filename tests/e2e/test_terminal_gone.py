"""A run whose terminal goes away: a reader of its output that quits (``| head``) leaves the run
going to its end; a hang-up (the terminal or SSH session closed) stops it the Ctrl-C way, with a
summary and no worker left running. Either used to kill the CLI at once, without a summary. A run
started with no terminal at all (its standard streams closed) runs to its end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_cli import ROOT, _write_config
from tests.e2e.test_run_failure_cli import _alive, _finish, _pid, _workers_once_training


def _start(tmp_path: Path, tiny_model: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "astraflow", "run", str(_write_config(tmp_path, tiny_model)), "--run-dir", str(run_dir),
         "--set", "workload.eval.every=0", *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # the hang-up's default action, whatever this test runner inherited (nohup ignores it)
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
    )
    return proc, run_dir


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_reader_that_quits_leaves_the_run_going_to_its_end(tiny_model, tmp_path):
    proc, run_dir = _start(tmp_path, tiny_model, "--set", "run.max_steps=6")
    try:
        assert proc.stdout.readline()  # the first progress line; then the reader goes away
        proc.stdout.close()
        err = proc.stderr.read()
        rc = proc.wait(240)
    finally:
        if proc.poll() is None:
            proc.kill()  # the CLI this test started, by its PID
            proc.wait(30)
    assert rc == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"]["solver"] == 6


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_hang_up_stops_the_run_with_a_summary_and_no_worker_left(tiny_model, tmp_path):
    proc, run_dir = _start(tmp_path, tiny_model, "--quiet", "--set", "run.max_steps=1000",
                           "--set", "workload.workflow=tests.slurm.slow_workflow:slow_single_turn_test")
    try:
        workers = _workers_once_training(proc, run_dir)
        killed_at = time.monotonic()
        os.kill(proc.pid, signal.SIGHUP)
        rc, lines, everything, _ = _finish(proc, killed_at)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert rc == 130, everything[-3000:]
    assert "Traceback" not in everything, everything[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["reason"].startswith("stopped by SIGHUP (its terminal closed")
    assert summary["ledger_closed"]
    assert not [n for n, w in workers.items() if _alive(_pid(w))], "worker processes were left running"


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_run_started_with_its_standard_input_and_output_closed_completes(tiny_model, tmp_path):
    """``astraflow run ... <&- >&-`` (a daemon's child): its progress goes nowhere, and the run
    completes. Python had no ``sys.stdout`` then, and the run failed on its first use."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "astraflow", "run", str(_write_config(tmp_path, tiny_model)), "--run-dir", str(run_dir),
         "--set", "workload.eval.every=0", "--set", "run.max_steps=2"],
        cwd=ROOT, stderr=subprocess.PIPE, text=True, timeout=240,
        preexec_fn=lambda: (os.close(0), os.close(1)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"]["solver"] == 2
