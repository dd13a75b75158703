"""A run whose Dask scheduler is killed ends within seconds in one line naming it and the resume
(not after the client's 30 s reconnect, nor with Dask's own error lines on the terminal), and
exits 75: the head job requeues itself on it, and the run resumes."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.e2e.test_run_failure_cli import _alive, _finish, _pid, _running, _workers_once_training


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_killed_scheduler_ends_the_run_at_once_in_one_line(tiny_model, tmp_path):
    with _running(tmp_path, tiny_model) as (proc, run_dir):
        workers = _workers_once_training(proc, run_dir)
        info = json.loads((run_dir / "control" / "orchestrator.json").read_text())
        sched = next(p for p in os.listdir("/proc") if p.isdigit() and _is_scheduler_of(int(p), proc.pid))
        killed_at = time.monotonic()
        os.kill(int(sched), signal.SIGKILL)  # the scheduler this test's run started
        rc, lines, everything, took = _finish(proc, killed_at)
    assert info["pid"] == proc.pid
    assert rc == 75, everything[-3000:]
    assert len(lines) == 1 and lines[0].startswith("Error: the run failed: the Dask scheduler was killed by signal 9")
    assert "distributed.client" not in everything, everything[-3000:]
    # under the client's 30 s of reconnects: the run did not wait them out
    assert took < 29, f"the run took {took:.0f}s to see its scheduler gone"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "resume" in summary["reason"] and summary["requeue"] is True
    assert not [n for n, w in workers.items() if _alive(_pid(w))], "worker processes were left running"


def _is_scheduler_of(pid: int, parent: int) -> bool:
    """Whether ``pid`` is the Dask scheduler process started by the run ``parent``."""
    try:
        stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return False
    return int(stat[1]) == parent and b"scheduler" in cmdline and b"schedulers.dask_main" in cmdline
