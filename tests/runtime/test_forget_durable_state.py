"""A run resumed with ``dataflow.durable: false`` removes the data layer's snapshot and change
log an earlier incarnation left: they stop being kept up to date, and a later durable resume
would otherwise go back to them, behind every version trained meanwhile."""

from __future__ import annotations

from types import SimpleNamespace

from astraflow.dataflow.changelog import log_path
from astraflow.runtime.launch import forget_durable_state
from astraflow.runtime.progress import Progress
from storage.paths import RunPaths


def _leftovers(run_dir):
    snapshot = RunPaths(run_dir).dataflow_snapshot
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    snapshot.write_bytes(b"base")
    log_path(snapshot, 3).write_bytes(b"log")
    return snapshot


def test_not_durable_removes_the_earlier_snapshot_and_its_log(tmp_path):
    snapshot = _leftovers(tmp_path)
    forget_durable_state(SimpleNamespace(dataflow=SimpleNamespace(durable=False)), tmp_path, Progress(enabled=False))
    assert not snapshot.exists() and not log_path(snapshot, 3).exists()


def test_durable_keeps_them(tmp_path):
    snapshot = _leftovers(tmp_path)
    forget_durable_state(SimpleNamespace(dataflow=SimpleNamespace(durable=True)), tmp_path, Progress(enabled=False))
    assert snapshot.exists() and log_path(snapshot, 3).exists()
