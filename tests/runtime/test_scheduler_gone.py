"""A run whose Dask scheduler process died ends with one line naming it, its log and the resume."""

from __future__ import annotations

import signal
import subprocess
import sys
from types import SimpleNamespace

from astraflow.runtime.placement import Placement
from astraflow.runtime.progress import Progress
from astraflow.sections import ClusterConfig
from storage.paths import RunPaths


def test_the_reason_names_the_scheduler_its_end_and_the_resume(tmp_path):
    placement = Placement(RunPaths(tmp_path / "run"), ClusterConfig(), Progress(enabled=False))
    assert placement.scheduler_gone() is None  # not started
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    placement.scheduler_proc = SimpleNamespace(proc=proc)
    try:
        assert placement.scheduler_gone() is None  # running
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    why = placement.scheduler_gone()
    assert why is not None and why.startswith("the Dask scheduler was killed by signal 9 (its log: "), why
    assert "scheduler" in why.split("its log: ")[1] and why.endswith("run `astraflow run` on the run directory "
                                                                       "again to resume it"), why
