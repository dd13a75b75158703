"""``astraflow tensorboard --follow`` on a directory where no run appears: an error after the
grace time, not a poll that never ends. TensorBoard is optional: a recording stand-in replaces
its writer (the process boundary is the event files, not what is tested here)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import types

import pytest

from astraflow.runtime.monitoring.export import export_tensorboard
from storage.paths import RunPaths


@pytest.fixture
def scalars(monkeypatch):
    got: list[tuple] = []

    class SummaryWriter:
        def __init__(self, log_dir):
            pass

        def add_scalar(self, tag, value, global_step):
            got.append((tag, value, global_step))

        def flush(self):
            pass

        def close(self):
            pass

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = SummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    return got


@pytest.mark.timeout(30)
def test_following_a_directory_where_no_run_appears_ends_with_an_error(tmp_path, scalars):
    with pytest.raises(ValueError, match="no run in .* after 1 s.*--run-dir of a run that started"):
        export_tensorboard(tmp_path, follow=True, poll_s=0.05, start_grace_s=1.0)


def test_a_finished_runs_metrics_are_mirrored(tmp_path, scalars):
    paths = RunPaths(tmp_path)
    paths.metrics.parent.mkdir(parents=True, exist_ok=True)
    paths.metrics.write_text(json.dumps({"policy": "p", "step": 3, "loss": 0.5}) + "\n")
    paths.summary.write_text("{}")
    assert export_tensorboard(tmp_path, follow=True, poll_s=0.05, start_grace_s=1.0) == 1
    assert scalars == [("p/loss", 0.5, 3)]


def test_event_files_are_not_written_into_a_run_directory_another_user_can_change(tmp_path, scalars):
    """Its symlinks there could make us overwrite a file of ours: refused unless --logdir is given."""
    paths = RunPaths(tmp_path / "run").make()
    paths.metrics.write_text(json.dumps({"policy": "p", "step": 1, "reward_mean": 0.5}) + "\n")
    paths.root.chmod(0o777)
    with pytest.raises(ValueError, match="writable by group/others.*pass --logdir"):
        export_tensorboard(paths.root)
    assert export_tensorboard(paths.root, tmp_path / "tb") == 1


@pytest.mark.timeout(30)
def test_following_a_run_killed_before_its_first_status_ends(tmp_path, scalars):
    """Its orchestrator file names a process that is gone and no status will ever come: the
    mirror stops, as for a run whose status went stale, instead of polling for ever."""
    paths = RunPaths(tmp_path / "run").make()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    paths.orchestrator_file.write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname(),
                                                   "started": time.time() - 5}))
    assert export_tensorboard(paths.root, logdir=tmp_path / "tb", follow=True, poll_s=0.05, start_grace_s=1.0) == 0
