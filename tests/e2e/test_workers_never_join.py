"""Worker jobs that end before they join (a setting they cannot parse, a missing module, another
Python) stop the run at once with what their logs say, instead of after the whole
``cluster.worker_start_timeout_s`` with only "did not join"."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from astraflow.runtime.cluster import last_error_line as _last_error
from tests.e2e.test_cli import ROOT, _write_config


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_workers_that_cannot_start_fail_the_run_with_their_error(tiny_model, tmp_path):
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "astraflow", "run", str(_write_config(tmp_path, tiny_model)), "--run-dir",
         str(tmp_path / "run"), "--quiet", "--set", "cluster.worker_start_timeout_s=600",
         # a Dask setting the workers cannot parse: their jobs fail before they join
         "--set", 'partitions.rollout.env={DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL: "soon"}'],
        cwd=ROOT, capture_output=True, text=True, timeout=280)
    took = time.monotonic() - t0
    assert res.returncode == 1, res.stderr[-3000:]
    assert "worker job(s) ended before joining the Dask scheduler" in res.stderr
    assert "KeyError: 'Invalid time unit: soon" in res.stderr and "rollout-rollout-local-cpu-0 (FAILED)" in res.stderr
    assert took < 200, f"the run waited {took:.0f}s for workers that had ended"


def test_the_error_quoted_is_the_cause_dask_wrapped():
    log = ["2026-01-01 - distributed.worker - INFO - Stopping worker", "Traceback (most recent call last):",
           "  File \"x.py\", line 1, in f", "ValueError: 'nope0' is not a valid network interface", "",
           "The above exception was the direct cause of the following exception:",
           "Traceback (most recent call last):", "RuntimeError: Worker failed to start."]
    assert _last_error(log) == "ValueError: 'nope0' is not a valid network interface"
    assert _last_error(["ModuleNotFoundError: No module named 'astraflow'"]).startswith("ModuleNotFoundError")
    assert _last_error(["slurmstepd: error: *** JOB 12 CANCELLED ***"]) == "slurmstepd: error: *** JOB 12 CANCELLED ***"
    assert _last_error([]) == "its log is empty"


def test_a_local_worker_s_log_is_read_from_its_latest_start(tmp_path):
    """A local worker's log keeps every start of its name: an earlier start's error, fixed since,
    is not the one quoted."""
    from schedulers.local import JOB_START_MARK, job_lines

    log = tmp_path / "rollout-r-local-cpu-0.log"
    log.write_text(f"{JOB_START_MARK} rollout-r-local-cpu-0 2026-01-01 00:00:00\nTraceback (most recent call last):\n"
                   "ValueError: ib0 has no IPv4 address\n"
                   f"{JOB_START_MARK} rollout-r-local-cpu-0 2026-01-01 01:00:00\nKilled\n")
    assert _last_error(job_lines(log)) == "Killed"
    assert job_lines(tmp_path / "missing.log") == []


@pytest.mark.parametrize("error, hinted", [
    ("/var/spool/slurmd/job00019/slurm_script: line 21: module: command not found", False),
    ("OSError: Timed out trying to connect to tls://127.0.0.1:42375 after 30 s", True),
])
def test_the_scheduler_address_hint_comes_only_with_a_failure_to_connect(tmp_path, monkeypatch, error, hinted):
    """A worker job that failed on its site setup line is not told to fix how workers reach the
    scheduler: the hint only goes with a worker that ended failing to connect."""
    from astraflow.config import ClusterConfig
    from astraflow.runtime.placement import Placement
    from astraflow.runtime.progress import Progress
    from astraflow.runtime.workers import RunFailed
    from storage.paths import RunPaths

    log = tmp_path / "w.log"
    log.write_text(error + "\n")
    placement = Placement(RunPaths(tmp_path / "run").make(), ClusterConfig(), Progress(enabled=False))
    monkeypatch.setattr(placement, "joined", lambda: {})
    monkeypatch.setattr("astraflow.runtime.placement.time.sleep", lambda s: None)
    clock = iter(range(0, 10_000, 3))
    monkeypatch.setattr("astraflow.runtime.placement.time.time", lambda: float(next(clock)))
    with pytest.raises(RunFailed) as err:
        placement.wait_workers(["rollout-h100-local-H100-0"], lambda: {"rollout-h100-local-H100-0": "FAILED"},
                               lambda name: log, hint="the Dask scheduler listens on 127.0.0.1")
    assert error in str(err.value) and ("listens on 127.0.0.1" in str(err.value)) == hinted, str(err.value)
