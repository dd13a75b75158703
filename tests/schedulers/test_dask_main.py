"""``schedulers.dask_main``: the Dask worker and scheduler run as ``dask worker|scheduler``, a
worker writes its stacks to its log on SIGUSR2 and closes on SIGTERM, both end with the
command's own exit code and flush what they logged before they go."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from schedulers.dask_main import close_workers_on_signal, exit_code
from tests.schedulers.dask_fixtures import dask_scheduler, wait_for_workers  # noqa: F401  (a fixture)


def test_exit_codes_follow_system_exit():
    assert exit_code(None) == 0
    assert exit_code(3) == 3
    assert exit_code(256 + 2) == 2
    assert exit_code("bad option") == 1


def _worker(address: str, name: str, log, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "schedulers.dask_main", "worker", address, "--name", name,
                             "--nthreads", "1", "--no-nanny", "--no-dashboard", *extra],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


@contextmanager
def _joined_worker(client, address: str, name: str, log_path, env: dict | None = None):
    """A worker of this test, joined to the scheduler; killed on the way out if it still runs."""
    with open(log_path, "wb") as log:
        proc = _worker(address, name, log, "--death-timeout", "30", env=env)
    try:
        assert name in wait_for_workers(client, {name}, present=True, deadline_s=60)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(120)
def test_a_worker_dumps_its_stacks_on_sigusr2_and_a_sigterm_ends_it_with_code_0(dask_scheduler, tmp_path):
    address, _, client = dask_scheduler
    with _joined_worker(client, address, "w-0", tmp_path / "w.log") as proc:
        proc.send_signal(signal.SIGUSR2)  # every thread's stack into the log; the worker goes on
        deadline = time.monotonic() + 30
        while "most recent call first" not in (tmp_path / "w.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "most recent call first" in (tmp_path / "w.log").read_text()
        assert proc.poll() is None and "w-0" in wait_for_workers(client, {"w-0"}, present=True, deadline_s=10)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    log = (tmp_path / "w.log").read_text()
    assert "Reason: signal-15" in log  # closed on the signal, before the command's loop ends
    assert "End worker" in log  # the last line logged reached the file
    assert "w-0" not in wait_for_workers(client, {"w-0"}, present=False, deadline_s=30)


@pytest.mark.timeout(120)
def test_a_worker_that_cannot_reach_its_scheduler_keeps_its_failure_code(tmp_path):
    import socket

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(tmp_path / "w.log", "wb") as log:
        proc = _worker(f"tcp://127.0.0.1:{port}", "w-1", log, "--death-timeout", "2")
    assert proc.wait(timeout=60) == 1
    assert "Timed out starting worker" in (tmp_path / "w.log").read_text()


def test_an_unknown_command_is_refused_with_the_usage():
    out = subprocess.run([sys.executable, "-m", "schedulers.dask_main", "nanny"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and "worker|scheduler" in out.stderr


def test_a_dask_command_without_the_signal_hook_is_left_as_it_is():
    from types import SimpleNamespace

    cli = SimpleNamespace()
    close_workers_on_signal(cli)
    assert vars(cli) == {}
    hook = SimpleNamespace(wait_for_signals=lambda: None)
    original = hook.wait_for_signals
    close_workers_on_signal(hook)
    assert hook.wait_for_signals is not original  # wrapped: the workers close when it returns


@pytest.mark.timeout(120)
def test_started_inside_a_slurm_job_a_worker_outlives_sigterm_and_closes_on_sigint(dask_scheduler, tmp_path):
    """scancel signals every process of the job: the run's own Dask processes ignore SIGTERM and
    close when the run stops them (SIGINT), after it stopped what runs on them."""
    import os

    from schedulers.procs import IGNORE_TERM_ENV

    address, _, client = dask_scheduler
    with _joined_worker(client, address, "w-1", tmp_path / "w.log", env={**os.environ, IGNORE_TERM_ENV: "1"}) as proc:
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.5)
        assert proc.poll() is None and "w-1" in wait_for_workers(client, {"w-1"}, present=True, deadline_s=10)
        assert "SIGTERM ignored" in (tmp_path / "w.log").read_text()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    assert "Reason: signal-2" in (tmp_path / "w.log").read_text()
    assert "w-1" not in wait_for_workers(client, {"w-1"}, present=False, deadline_s=30)


def test_the_stop_signal_is_sigint_inside_a_slurm_job_only(monkeypatch):
    from schedulers.procs import IGNORE_TERM_ENV, stop_env, stop_signal

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert stop_signal() == signal.SIGTERM and stop_env() == {}
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert stop_signal() == signal.SIGINT and stop_env() == {IGNORE_TERM_ENV: "1"}
