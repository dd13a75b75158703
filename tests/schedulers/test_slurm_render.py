"""Rendered worker job scripts, pinned by golden files (no Slurm needed).

Regenerate after an intended template change with
``ASTRAFLOW_UPDATE_GOLDEN=1 pytest tests/schedulers/test_slurm_render.py`` and review the diff.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from schedulers import Partition
from schedulers.command import QUIET_DASK_ENV, worker_env
from schedulers.slurm import SlurmScheduler, normalise_state

GOLDEN = Path(__file__).with_name("golden")
UPDATE = os.environ.get("ASTRAFLOW_UPDATE_GOLDEN") == "1"

SITE = dict(
    job_dir="/shared/runs/demo/jobs",
    python="/opt/astraflow/venv/bin/python",
    setup_lines=("module load cuda/12.4", "source /opt/astraflow/venv/bin/activate"),
    interface="ib0",
    tag="demo-run",
)

CASES = {
    "rollout_h100": (
        Partition(name="h100", scheduler="slurm", slurm_partition="gpu-h100", nodes=4, cpus_per_node=16,
                  gpus_per_node=4, gres="gpu:h100:4", mem="64G", walltime="04:00:00", region="eu",
                  hardware="H100", role="rollout", sbatch_options=("--account=proj42", "--qos=high"),
                  env={"HF_HOME": "/shared/hf cache", "VLLM_USE_V1": "1"}),
        "/shared/runs/demo/scheduler.json", 3, SITE,
    ),
    "trainer_a100": (
        Partition(name="a100", scheduler="slurm", nodes=1, cpus_per_node=32, gpus_per_node=8,
                  walltime="1-00:00:00", region="us", hardware="A100", role="trainer",
                  resources={"trainer": 1, "policy_main": 1}),
        "tcp://10.1.2.3:8786", 0, SITE,
    ),
    "data_cpu": (
        Partition(name="cpu", scheduler="slurm", slurm_partition="cpu", nodes=1, role="data", region="eu"),
        "tcp://127.0.0.1:8786", 0, dict(job_dir="/tmp/run/jobs", python="/usr/bin/python3", host="127.0.0.1"),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_script_matches_golden(case, tmp_path, monkeypatch):
    for key in QUIET_DASK_ENV:  # the script exports them unless the submitting shell sets them
        monkeypatch.delenv(key, raising=False)
    partition, address, index, site = CASES[case]
    script, argv = SlurmScheduler(**site).render(partition, address, index)
    text = script + "# sbatch argv: " + " ".join(argv) + "\n"
    golden = GOLDEN / f"{case}.sbatch"
    if UPDATE:
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}: run with ASTRAFLOW_UPDATE_GOLDEN=1 to create it"
    assert text == golden.read_text(), f"{case} changed: if intended, regenerate with ASTRAFLOW_UPDATE_GOLDEN=1"
    # and it is valid bash
    path = tmp_path / "job.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_render_refuses_local_partition():
    with pytest.raises(ValueError, match="scheduler: slurm"):
        SlurmScheduler("/tmp/j").render(Partition(name="x"), "tcp://127.0.0.1:1", 0)


@pytest.mark.parametrize(
    "raw, state",
    [("PENDING", "PENDING"), ("CONFIGURING", "PENDING"), ("RUNNING", "RUNNING"), ("COMPLETING", "RUNNING"),
     ("COMPLETED", "COMPLETED"), ("TIMEOUT", "FAILED"), ("NODE_FAIL", "FAILED"), ("OUT_OF_MEMORY", "FAILED"),
     ("CANCELLED by 0", "CANCELLED"), ("PREEMPTED", "CANCELLED"), ("SUSPENDED", "UNKNOWN"), ("", "UNKNOWN")],
)
def test_normalise_state(raw, state):
    assert normalise_state(raw) == state


def test_worker_env_quiets_dask_monitors_unless_set(monkeypatch):
    for key in QUIET_DASK_ENV:
        monkeypatch.delenv(key, raising=False)
    part = Partition(name="cpu", scheduler="local", role="data",
                     env={"DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL": "20ms"})
    monkeypatch.setenv("DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED", "True")
    env = worker_env(part, "data-cpu-local-cpu-0")
    assert env["DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL"] == "20ms"  # the partition's value wins
    assert "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED" not in env  # the shell's value is inherited
    assert env["DASK_DISTRIBUTED__WORKER__MEMORY__MONITOR_INTERVAL"] == "1s"
    assert env["ASTRAFLOW_ROLE"] == "data"
