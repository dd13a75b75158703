"""Ranks that die between commands, ranks that exit after answering ``stop``, and what a
backend leaves behind: real rank processes. The backends' work directories go to this test's
own temporary directory, where the tests look for them."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from astraflow.training.megatron.backend import MegatronBackend, MegatronBackendConfig
from astraflow.training.megatron.launch import RankError, RankKilled
from tests.megatron.helpers import grpo_batch, prompts, save_tiny_llama

#: one GPU per rank: two ranks need two GPUs, or none (gloo on CPU)
two_ranks = pytest.mark.skipif(torch.cuda.device_count() == 1, reason="two ranks need two GPUs")


@pytest.fixture
def tmpdir_root(tmp_path, monkeypatch) -> Path:
    """The directory ``tempfile`` (and so a backend's work directory) uses during the test."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def _workdirs(root: Path) -> list[Path]:
    return sorted(d for d in root.glob("astraflow-megatron-*") if not d.name.startswith("astraflow-megatron-ranks-"))


def _left_in(root: Path) -> list[str]:
    """The processes (pid and command) still working in a directory under ``root``: what a rank
    started lives in the rank's working directory."""
    import psutil

    left = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.cwd().startswith(str(root)):
                left.append(f"{proc.info['pid']}: {' '.join(proc.info['cmdline'] or [])}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return left


def _kill(proc) -> None:
    """SIGKILL one rank process (as the OOM killer would) and wait until it is gone."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@two_ranks
@pytest.mark.timeout(180)
def test_a_rank_that_died_between_commands_is_reported_and_the_others_stopped(tmp_path, tmpdir_root):
    hf = save_tiny_llama(tmp_path / "hf", tied=True)
    logs = tmp_path / "logs"
    be = MegatronBackend(MegatronBackendConfig(hf_checkpoint=str(hf), dp_size=2, lr=1e-3, start_timeout_s=120,
                                               step_timeout_s=60, log_dir=str(logs)))
    procs = list(be._ranks.procs)
    try:
        toks = prompts()
        lp = be.logprobs(toks)
        _kill(procs[1])
        with pytest.raises(RankKilled) as err:  # a RankError that the trainer reports as a lost process
            be.train_step(grpo_batch(toks, lp))
        msg = str(err.value)
        assert msg.startswith("rank(s) [1] exited before 'train': rank 1 was killed by SIGKILL, as the "
                              "out-of-memory killer kills\n"), msg
        assert f"--- rank 1 log ({logs / 'megatron-rank1.log'})" in msg
        assert all(p.poll() is not None for p in procs)  # the surviving rank was stopped too
        be.close()  # nothing left to stop: no error
        with pytest.raises(RankError, match=r"^the backend's ranks were stopped: rank\(s\) \[1\] exited before "
                           r"'train': rank 1 was killed by SIGKILL, .*; 'logprobs' needs a new backend"):
            be.logprobs(toks)
        # the logs are in log_dir: the work directory holds nothing the error points at
        assert _workdirs(tmpdir_root) == []
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p)


@pytest.mark.timeout(120)
def test_closing_a_backend_whose_rank_died_reports_the_rank(tmp_path, tmpdir_root):
    hf = save_tiny_llama(tmp_path / "hf", tied=True)
    be = MegatronBackend(MegatronBackendConfig(hf_checkpoint=str(hf), start_timeout_s=120, step_timeout_s=60))
    procs = list(be._ranks.procs)
    try:
        _kill(procs[0])
        with pytest.raises(RankError, match=r"^rank\(s\) \[0\] exited before 'stop'") as err:
            be.close()
        # the default logs live in the work directory, which is kept for them
        (workdir,) = _workdirs(tmpdir_root)
        assert f"--- rank 0 log ({workdir / 'megatron-rank0.log'})" in str(err.value)
        be.close()
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p)


@two_ranks
@pytest.mark.timeout(180)
def test_close_waits_for_a_slow_rank_while_a_fast_one_has_exited(tmp_path, tmpdir_root):
    """Rank 0 answers ``stop`` and exits at once; rank 1 is held (SIGSTOP) for 2 s before it
    answers: a rank that answered and exited is not a crash."""
    hf = save_tiny_llama(tmp_path / "hf", tied=True)
    be = MegatronBackend(MegatronBackendConfig(hf_checkpoint=str(hf), dp_size=2, lr=1e-3, start_timeout_s=120,
                                               step_timeout_s=60))
    procs = list(be._ranks.procs)
    slow = procs[1]

    def resume():
        try:
            os.kill(slow.pid, signal.SIGCONT)
        except ProcessLookupError:  # already stopped by the backend
            pass

    timer = threading.Timer(2.0, resume)
    try:
        be.logprobs(prompts())
        os.kill(slow.pid, signal.SIGSTOP)
        timer.start()
        be.close()
        assert [p.returncode for p in procs] == [0, 0]
        assert _workdirs(tmpdir_root) == []  # a clean stop removes the work directory
    finally:
        timer.cancel()
        for p in procs:
            if p.poll() is None:
                _kill(p)


def test_the_process_group_waits_as_long_as_the_backend(tmp_path, monkeypatch):
    """The ranks' collectives (the save barrier, a checkpoint's gather) time out no sooner than
    the backend's own deadline for the command, or for the start when that is longer."""
    from astraflow.training.megatron import model, rank
    from astraflow.training.megatron.model import DistSpec

    hf = save_tiny_llama(tmp_path / "hf", tied=True)
    seen = []

    class Reached(Exception):
        pass

    def init_distributed(spec, timeout_s):
        seen.append(timeout_s)
        raise Reached

    monkeypatch.setattr(model, "init_distributed", init_distributed)
    threads = torch.get_num_threads()  # Rank sets the process's threads first
    try:
        for step, start in ((900.0, 300.0), (600.0, 1200.0)):
            cfg = asdict(MegatronBackendConfig(hf_checkpoint=str(hf), step_timeout_s=step, start_timeout_s=start))
            cfg.pop("env")  # as the backend sends it
            with pytest.raises(Reached):
                rank.Rank(DistSpec(rank=0, world_size=1, init_method="file:///nonexistent", tp_size=1), cfg)
    finally:
        torch.set_num_threads(threads)
    assert seen == [900.0, 1200.0]


# -- the trainer loop around a failed backend ----------------------------------------------------
def _done(value=None):
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_result(value)
    return fut


class _KillingDataLayer:
    """Stands in for the data-layer handle: serves one batch again and again; before serving the
    ``kill_at``-th it kills the backend's rank 0 (set ``procs``)."""

    _worker = "test"

    def __init__(self, batch, kill_at: int):
        self.batch, self.kill_at, self.served = batch, kill_at, 0
        self.procs: list = []

    def next_batch(self, policy, version, timeout):
        self.served += 1
        if self.served == self.kill_at:
            _kill(self.procs[0])
        return _done(type(self.batch)(policy=policy, version=version, items=self.batch.items))

    def published(self, *args, **kwargs):
        return _done()


@pytest.mark.timeout(180)
def test_a_trainer_whose_rank_died_reports_it_and_leaves_no_rank_running(tmp_path, tmpdir_root):
    """Saving the optimiser state on the loop's way out needs the dead backend: it is logged,
    not raised, and the trainer's error stays the rank's."""
    from astraflow.training.config import TrainerConfig
    from astraflow.training.trainer import Trainer

    hf = save_tiny_llama(tmp_path / "hf", tied=True)
    dl = _KillingDataLayer(grpo_batch(prompts(), np.full((4, 11), -5.0, np.float32)), kill_at=2)
    tr = Trainer(policy="p", cfg=TrainerConfig(backend="megatron", lr=1e-3, optimizer_checkpoint_every=0),
                 model_path=str(hf), weights_root=str(tmp_path / "w"), keep_versions=5, data_layer=dl,
                 max_steps=4, optimizer_path=str(tmp_path / "state" / "opt.pt"))
    tr.start(run_loop=False)
    dl.procs = procs = list(tr.backend._ranks.procs)
    try:
        tr._run()  # the loop, in this thread: it returns, whatever failed
        st = tr.state()
        assert st["error"].startswith("RankKilled: rank(s) [0] exited before 'train'"), st["error"]
        assert st["error_lost"]  # the run restarts such a trainer as it does one whose worker was lost
        assert st["version"] == 1 and not st["done"]
        assert all(p.poll() is not None for p in procs)
        assert not (tmp_path / "state" / "opt.pt").exists()
        deadline = time.monotonic() + 10  # SIGKILL is sent; the kernel takes a moment to end them
        while _left_in(tmpdir_root) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _left_in(tmpdir_root) == [], "what the killed rank started is still running"
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p)
