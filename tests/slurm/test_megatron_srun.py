"""A multi-node Megatron trainer on a real (local) Slurm: the worker job of a trainer partition
with ``nodes_per_worker: 2`` (rendered from the real template: 2 nodes, one task and one fake GPU
per node) runs one Dask worker, on its first node; a TP=1 x DP=2 backend called in that worker
starts its ranks as one srun step over both nodes (``env://`` rendezvous, TCP control channel),
takes the step the same backend takes with local subprocess ranks, publishes it, and leaves
nothing running when it closes; a rank that fails ends the step and the backend names it.
CPU gloo; skipped when Slurm does not answer."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from schedulers import Partition  # noqa: E402
from schedulers.slurm import SlurmScheduler, run_slurm  # noqa: E402
from tests.megatron.helpers import save_tiny_llama  # noqa: E402
from tests.schedulers.dask_fixtures import wait_for_workers  # noqa: E402
from tests.slurm.megatron_driver import start_with_a_failing_rank, train_once  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.megatron]
TOL = 1e-6


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _steps(job_id: str) -> list[str]:
    """The job's running steps other than its batch step (``squeue --steps``)."""
    out = run_slurm(["squeue", "--steps", "-h", "-j", job_id, "-o", "%i"])
    return [s for s in out.split() if not s.endswith((".batch", ".extern"))]


@pytest.mark.timeout(900)
def test_srun_ranks_across_two_nodes_take_the_local_step(tmp_path, dask_scheduler):
    address, _, client = dask_scheduler
    hf_dir = str(save_tiny_llama(tmp_path / "hf", tied=True))
    part = Partition(name="mn", scheduler="slurm", slurm_partition="h100", nodes=1, nodes_per_worker=2,
                     cpus_per_node=2, gpus_per_node=1, gres="gpu:h100:1", mem="2G", role="trainer",
                     walltime="00:20:00")
    sched = SlurmScheduler(tmp_path / "jobs", interface="lo", tag=f"aftest-{uuid.uuid4().hex[:8]}", death_timeout=60)
    (ref,) = sched.submit(part, address, 1)
    try:
        script = Path(sched.script_path(ref.worker_name)).read_text()
        assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n" in script
        connected = wait_for_workers(client, {ref.worker_name}, True, 120)
        assert ref.worker_name in connected, f"the trainer worker did not join; log: {ref.log}"
        workers = client.scheduler_info()["workers"]
        assert [w["name"] for w in workers.values()] == [ref.worker_name]  # one Dask worker for the 2-node job
        info = client.run(lambda: {k: os.environ.get(k) for k in ("SLURM_JOB_NUM_NODES", "SLURMD_NODENAME")},
                          workers=list(workers))
        assert list(info.values()) == [{"SLURM_JOB_NUM_NODES": "2", "SLURMD_NODENAME": "h100-1"}]

        fut = client.submit(train_once, hf_dir, str(tmp_path / "srun"), "auto", pure=False,
                            workers=[ref.worker_name])
        multi = fut.result(timeout=800)
        local = train_once(hf_dir, str(tmp_path / "local"), "local")

        assert multi["launcher"] == "SrunRanks" and local["launcher"] == "LocalRanks"
        cmd = multi["command"]
        assert cmd[0] == "srun" and f"--jobid={ref.job_id}" in cmd and "--ntasks=2" in cmd
        assert "--ntasks-per-node=1" in cmd and "--kill-on-bad-exit=1" in cmd
        assert multi["step"].startswith(f"{ref.job_id}.")
        assert multi["srun_returncode"] == 0  # the step ended by itself after "stop"
        logs = sorted(p.name for p in (tmp_path / "srun" / "logs").iterdir())
        assert logs == ["megatron-rank0.log", "megatron-rank1.log", "megatron-srun.log"]

        assert multi["metrics"]["loss"] == pytest.approx(local["metrics"]["loss"], abs=1e-6)
        assert _max_diff(multi["state"], local["state"]) < TOL
        assert _max_diff(multi["published"], local["published"]) < TOL
        before = read_hf(hf_dir)
        assert _max_diff({k: multi["state"][k] for k in before}, before) > 1e-4  # the step moved the weights

        assert [w["node"] for w in multi["where"]] == ["h100-1", "h100-2"]  # one rank on each node
        # everything it started has stopped: the ranks (same host here) and the job step
        assert not [w for w in multi["where"] if _alive(int(w["pid"]))]
        assert _steps(ref.job_id) == []

        # a rank that fails ends the whole step (--kill-on-bad-exit): the backend says which and why
        err = client.submit(start_with_a_failing_rank, hf_dir, str(tmp_path / "failing"), pure=False,
                            workers=[ref.worker_name]).result(timeout=600)
        assert err.startswith("RankError: rank") and "during 'init'" in err, err
        assert "task 1: Exited with exit code 1" in err  # srun's own words, from its log
        assert "rank 1 fails on purpose" in (tmp_path / "failing" / "logs" / "megatron-rank1.log").read_text()
        assert _steps(ref.job_id) == []
    finally:
        sched.cancel([ref.job_id])
    print(json.dumps({"step": multi["step"], "where": multi["where"], "error": err.splitlines()[0],
                      "weights_max_diff": _max_diff(multi["state"], local["state"])}))


def read_hf(hf_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(hf_dir) / "model.safetensors"))
