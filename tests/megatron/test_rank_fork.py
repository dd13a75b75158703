"""Local ranks forked from the process's rank fork server: every backend of the process forks
from the one server (Megatron imported once), a rank whose environment differs from the
server's starts fresh and says why, and the control socket is found however long the
backend's work directory is."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
import torch

pytest.importorskip("megatron.core")

from astraflow.training.megatron import launch  # noqa: E402
from astraflow.training.megatron.backend import MegatronBackend, MegatronBackendConfig  # noqa: E402
from schedulers.forkserver import ForkedProcess  # noqa: E402
from tests.megatron.helpers import loss_fn_name, prompts, save_tiny_llama  # noqa: E402

pytestmark = pytest.mark.megatron


def _backend(hf_dir: Path, **kw) -> MegatronBackend:
    return MegatronBackend(MegatronBackendConfig(hf_checkpoint=str(hf_dir), lr=1e-3, loss_fn=loss_fn_name(),
                                                 start_timeout_s=120, step_timeout_s=120, **kw))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU ranks (gloo); a GPU host forks them the same way")
def test_backends_of_one_process_fork_their_ranks_from_one_server_and_a_misfit_starts_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "_fork_server", None)  # this test's own server, not an earlier test's
    try:
        _fork_twice_then_misfit(tmp_path)
    finally:
        launch.close_rank_fork_server()


def _fork_twice_then_misfit(tmp_path: Path) -> None:
    hf_dir = save_tiny_llama(tmp_path / "hf", tied=True)
    toks = prompts()
    parents, logprobs = [], []
    for _ in range(2):
        with _backend(hf_dir) as be:
            (rank,) = be._ranks.procs
            assert isinstance(rank, ForkedProcess)
            parents.append(psutil.Process(rank.pid).ppid())
            logprobs.append(be.logprobs(toks))
    server = launch._fork_server
    assert server is not None and server.alive and parents == [server._proc.pid] * 2
    assert (logprobs[0] == logprobs[1]).all()  # a forked rank builds the same model each time

    with _backend(hf_dir, env={"RANK_FORK_TEST_VAR": "x"},
                  log_dir=str(tmp_path / "logs")) as be:
        (rank,) = be._ranks.procs
        assert isinstance(rank, subprocess.Popen) and (be.logprobs(toks) == logprobs[0]).all()
    said = (tmp_path / "logs" / "megatron-rank0.log").read_text()
    assert "not forked: its environment sets RANK_FORK_TEST_VAR otherwise" in said
    assert launch._fork_server is server and server.alive  # kept for the backends that still fit


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
