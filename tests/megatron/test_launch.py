"""The multi-node launch path without a cluster: the ``srun`` line the backend builds (golden),
the allocation check, and the TCP control channel (real sockets and the real rank side:
a peer without the launch's token, a silent one, or one naming a taken rank is dropped, and
the ranks come back in rank order).

Regenerate the golden file after an intended change with
``ASTRAFLOW_UPDATE_GOLDEN=1 pytest tests/megatron/test_launch.py`` and review the diff.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import threading
import time
from multiprocessing.connection import AuthenticationError, Client
from pathlib import Path

import pytest

from astraflow.training.megatron.launch import RANK_MODULE, RankError, accept_ranks, rank_channel
from astraflow.training.megatron.slurm import Allocation, srun_command

GOLDEN = Path(__file__).with_name("golden")
UPDATE = os.environ.get("ASTRAFLOW_UPDATE_GOLDEN") == "1"
pytestmark = pytest.mark.timeout(120)


def test_srun_command_of_a_2_node_by_4_gpu_trainer_matches_golden():
    alloc = Allocation(job_id="4242", nodes=("gpu-017", "gpu-018"), ranks_per_node=4, cpus_per_rank=8,
                       master_addr="10.1.0.17")
    argv = srun_command(alloc, 8, Path("/scratch/runs/exp 1 (50%)/megatron"), "/opt/astraflow/venv/bin/python",
                        RANK_MODULE)
    text = shlex.join(argv) + "\n"
    golden = GOLDEN / "srun_2x4.txt"
    if UPDATE:
        golden.write_text(text)
    assert text == golden.read_text(), "the srun line changed: if intended, regenerate with ASTRAFLOW_UPDATE_GOLDEN=1"
    assert "--ntasks=8" in argv and "--ntasks-per-node=4" in argv and "--kill-on-bad-exit=1" in argv


def test_ranks_that_do_not_fill_the_allocation_are_refused_with_both_numbers():
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol is not installed (it expands the job's node list)")
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu-[1-2]", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_NTASKS_PER_NODE": "4"}
    assert Allocation.spans_nodes(env) and not Allocation.spans_nodes({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1"})
    with pytest.raises(ValueError, match=r"= 4 ranks, and the trainer's Slurm job 7 has 2 node\(s\) with 4 task\(s\) "
                                         r"per node.*nodes_per_worker x gpus_per_node"):
        Allocation.from_env(4, env)
    with pytest.raises(ValueError, match="runs in none"):
        Allocation.from_env(4, {})


def _rank(rank: int, port: int, token: str, out: dict, monkeypatch_env: dict) -> None:
    """What a rank does at start (``launch.rank_channel``), in a thread: the environment it reads
    is passed in, as srun would set it."""
    saved = {k: os.environ.get(k) for k in monkeypatch_env}
    os.environ.update(monkeypatch_env)
    try:
        out[rank] = rank_channel(rank)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_control_channel_takes_only_peers_with_the_token(monkeypatch):
    token = "s3cret-" + "x" * 40
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    env = {"ASTRAFLOW_RANK_CONTROL": f"127.0.0.1:{port}", "SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0"}
    rank_env_lock = threading.Lock()  # rank_channel reads and pops os.environ: one at a time
    ranks: dict[int, object] = {}

    def good(rank: int) -> None:
        with rank_env_lock:
            _rank(rank, port, token, ranks, dict(env, ASTRAFLOW_RANK_TOKEN=token))

    intruder_error: list[BaseException] = []

    def intruder() -> None:
        try:
            Client(("127.0.0.1", port), authkey=b"guessed")
        except (AuthenticationError, OSError, EOFError) as e:
            intruder_error.append(e)

    silent = socket.create_connection(("127.0.0.1", port))  # connects, never speaks
    threads = [threading.Thread(target=intruder), threading.Thread(target=good, args=(1,)),
               threading.Thread(target=good, args=(0,))]
    for t in threads:
        t.start()
    conns, hellos = accept_ranks(server, token.encode(), 2, time.monotonic() + 60, lambda: None)
    for t in threads:
        t.join(30)
    assert intruder_error, "a peer without the token was let in"
    assert [h["rank"] for h in hellos] == [0, 1] and hellos[0]["step"] == "9.0" and hellos[1]["pid"] == os.getpid()
    for r, conn in enumerate(conns):  # each connection reaches the rank it names
        conn.send(("ping", r))
        assert ranks[r].recv() == ("ping", r)
        ranks[r].send(("ok", r))
        assert conn.recv() == ("ok", r)
    assert "ASTRAFLOW_RANK_TOKEN" not in os.environ
    silent.close()
    server.close()


def test_accept_gives_up_at_its_deadline_or_when_the_launcher_dies():
    server = socket.create_server(("127.0.0.1", 0))
    with pytest.raises(RankError, match=r"ranks \[0, 1\] did not connect"):
        accept_ranks(server, b"t", 2, time.monotonic() + 0.5, lambda: None)

    def dead() -> None:
        raise RankError("srun exited (1)")

    with pytest.raises(RankError, match="srun exited"):
        accept_ranks(server, b"t", 2, time.monotonic() + 60, dead)
    server.close()
