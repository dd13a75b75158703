"""Local ranks forked from the process's rank fork server: every backend of the process forks
from the one server (Megatron imported once), a rank whose environment differs from the
server's starts fresh and says why, a save starts no helper interpreter, and the control socket
is found however long the backend's work directory is."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch

pytest.importorskip("megatron.core")

from astraflow.training.megatron import launch, rank_server  # noqa: E402
from astraflow.training.megatron.backend import MegatronBackend, MegatronBackendConfig  # noqa: E402
from schedulers.forkserver import ForkedProcess, ForkServer  # noqa: E402
from tests.megatron.helpers import loss_fn_name, prompts, save_tiny_llama  # noqa: E402

pytestmark = pytest.mark.megatron


def _backend(hf_dir: Path, **kw) -> MegatronBackend:
    return MegatronBackend(MegatronBackendConfig(hf_checkpoint=str(hf_dir), lr=1e-3, loss_fn=loss_fn_name(),
                                                 start_timeout_s=120, step_timeout_s=120, **kw))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU ranks (gloo); a GPU host forks them the same way")
def test_backends_of_one_process_fork_their_ranks_from_one_server_and_a_misfit_starts_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(rank_server, "_server", None)  # this test's own server, not an earlier test's
    monkeypatch.setattr(rank_server, "_directory", None)
    try:
        _fork_twice_then_misfit(tmp_path)
    finally:
        directory = rank_server._directory
        rank_server.close_rank_fork_server()
    assert directory is not None and not directory.exists()


def _fork_twice_then_misfit(tmp_path: Path) -> None:
    hf_dir = save_tiny_llama(tmp_path / "hf", tied=True)
    toks = prompts()
    parents, logprobs = [], []
    for i in range(2):
        with _backend(hf_dir) as be:
            (rank,) = be._ranks.procs
            assert isinstance(rank, ForkedProcess)
            # in this process's group, as a fresh rank: what stops the group stops it and its helpers
            assert os.getpgid(rank.pid) == os.getpgrp()
            parents.append(psutil.Process(rank.pid).ppid())
            logprobs.append(be.logprobs(toks))
            be.save_shards(tmp_path / f"v{i}")  # the shard writer's results stay in the rank's process:
            helpers = [" ".join(c.cmdline()) for c in psutil.Process(rank.pid).children(recursive=True)]
            assert not [c for c in helpers if "spawn_main" in c], helpers  # no spawned manager interpreter
    server = rank_server.current()
    assert server is not None and server.alive and parents == [server._proc.pid] * 2
    # its log and working directory are its own: the backends' work directories are gone
    assert server.log.is_file() and server.log.parent == rank_server._directory
    assert Path(psutil.Process(server._proc.pid).cwd()) == rank_server._directory.resolve()
    assert (logprobs[0] == logprobs[1]).all()  # a forked rank builds the same model each time

    with _backend(hf_dir, env={"RANK_FORK_TEST_VAR": "x"},
                  log_dir=str(tmp_path / "logs")) as be:
        (rank,) = be._ranks.procs
        assert isinstance(rank, subprocess.Popen) and (be.logprobs(toks) == logprobs[0]).all()
    said = (tmp_path / "logs" / "megatron-rank0.log").read_text()
    assert "not forked: its environment sets RANK_FORK_TEST_VAR otherwise" in said
    assert rank_server.current() is server and server.alive  # kept for the backends that still fit


def test_a_rank_reaches_the_control_socket_of_a_work_directory_too_long_for_a_socket_address(tmp_path):
    workdir = Path(tempfile.mkdtemp(dir=tmp_path))
    while len(str(workdir / launch.CONTROL_SOCKET)) <= launch._SUN_PATH_MAX:
        workdir = workdir / ("d" * 40)
    workdir.mkdir(parents=True)
    listener = launch._unix_listener(workdir, 1)
    try:
        # what a rank does: connect to the socket named relative to its working directory
        code = ("from multiprocessing.connection import Client; "
                f"c = Client({launch.CONTROL_SOCKET!r}, family='AF_UNIX'); c.send('hello'); c.close()")
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=workdir)
        listener.settimeout(30)
        conn, _ = listener.accept()
        with conn:
            assert b"hello" in conn.recv(1024)
        assert proc.wait(30) == 0
    finally:
        listener.close()


def test_a_fork_server_that_hangs_in_its_imports_is_given_up_at_the_start_deadline(tmp_path, monkeypatch):
    (tmp_path / "hangs_on_import.py").write_text("import time\ntime.sleep(600)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    server = ForkServer(sys.executable, ["hangs_on_import"], env, tmp_path / "server.log", sessions=False)
    monkeypatch.setattr(rank_server, "_server", server)
    try:
        t0 = time.monotonic()
        proc = launch._start_rank(server, env, tmp_path / "rank.log", tmp_path, deadline=t0 + 2)
        assert isinstance(proc, subprocess.Popen) and time.monotonic() - t0 < 30
        proc.wait(60)  # a rank without its launch's environment ends at once
        assert rank_server.current() is None  # the next launch starts another server
        assert "not forked: the fork server did not answer (it hangs)" in (tmp_path / "rank.log").read_text()
        # a variable set here since the server started: whether its imports set it too is asked
        # of the server, within the deadline as well
        monkeypatch.setattr(rank_server, "_server", server)
        monkeypatch.setenv("RANK_FORK_LATE_VAR", "1")
        t1 = time.monotonic()
        late = launch._start_rank(server, dict(env, RANK_FORK_LATE_VAR="1"), tmp_path / "late.log", tmp_path,
                                  deadline=t1 + 2)
        assert isinstance(late, subprocess.Popen) and time.monotonic() - t1 < 30
        late.wait(60)
        assert rank_server.current() is None
        assert "not forked: the fork server did not answer (it hangs)" in (tmp_path / "late.log").read_text()
    finally:
        server.close()
