"""A real Dask scheduler process on 127.0.0.1 for the scheduler-backend tests (imported by conftests)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from astraflow.runtime.cluster import connected_workers


def start_dask_scheduler(tmp: Path, deadline_s: float = 30.0) -> tuple[subprocess.Popen, str, Path]:
    """Start `dask scheduler` on loopback (as AstraFlow starts it); return (process, tcp address, scheduler file)."""
    sched_file = tmp / "scheduler.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "schedulers.dask_main", "scheduler", "--host", "127.0.0.1", "--port", "0",
         "--no-dashboard", "--scheduler-file", str(sched_file)],
        stdout=open(tmp / "scheduler.log", "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + deadline_s
    while True:  # Dask writes the file in place: it may be read empty or half written
        try:
            return proc, json.loads(sched_file.read_text())["address"], sched_file
        except (OSError, ValueError, KeyError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"dask scheduler did not start: {(tmp / 'scheduler.log').read_text()}")
        time.sleep(0.05)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def wait_for_workers(client, names: set[str], present: bool, deadline_s: float) -> set[str]:
    """Poll the scheduler until all `names` are (or none is) connected; return the connected names."""
    deadline = time.monotonic() + deadline_s
    while True:
        connected = {w["name"] for w in connected_workers(client).values()}
        if (names <= connected) if present else not (names & connected):
            return connected
        if time.monotonic() > deadline:
            return connected
        time.sleep(0.1)


@pytest.fixture
def dask_scheduler(tmp_path):
    """(tcp address, scheduler file, Client) of a fresh scheduler; stopped after the test."""
    from distributed import Client

    proc, address, sched_file = start_dask_scheduler(tmp_path)
    client = Client(address, timeout=20)
    yield address, sched_file, client
    client.close()
    stop(proc)
