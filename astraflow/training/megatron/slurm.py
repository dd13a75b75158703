"""The Slurm allocation a multi-node Megatron trainer runs in, and the ``srun`` line that starts
its ranks as a job step of it.

The trainer's worker job (``schedulers/templates/worker.sbatch.j2``) asks for ``--nodes N
--ntasks-per-node G`` (G = the partition's GPUs per node) and runs the Dask worker, with the
trainer actor and this backend, in its batch step on the first node only. The backend reads the
allocation from the batch step's environment and checks that its ``tensor_parallel *
data_parallel`` ranks fill it: G ranks on each of the N nodes, rank ``r`` on node ``r // G``
(block distribution), so a tensor-parallel group of up to G ranks stays on one node and rank 0,
the ``env://`` master, is on the first node with the backend.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

#: Slurm commands get this long to answer (a busy slurmctld is slow, a dead one never answers)
_SLURM_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Allocation:
    """The part of a Slurm job the ranks use."""

    job_id: str
    #: the job's nodes in allocation order (the first runs the batch step)
    nodes: tuple[str, ...]
    ranks_per_node: int
    #: CPUs Slurm gives each task of the job (its ``--cpus-per-task``)
    cpus_per_rank: int
    #: the first node's address as Slurm reaches it (``NodeAddr``): the rendezvous master and
    #: the backend's control listener, both on the node the backend runs on
    master_addr: str

    @staticmethod
    def spans_nodes(environ: Mapping[str, str] = os.environ) -> bool:
        """Whether this process runs inside a Slurm job of more than one node."""
        return bool(environ.get("SLURM_JOB_ID")) and int(environ.get("SLURM_JOB_NUM_NODES", "1") or 1) > 1

    @classmethod
    def from_env(cls, world: int, environ: Mapping[str, str] = os.environ) -> "Allocation":
        """The allocation of the job this process runs in, checked against ``world`` ranks.
        ``ValueError`` naming the numbers and the fix when they do not fit."""
        job_id = environ.get("SLURM_JOB_ID")
        if not job_id:
            raise ValueError("the srun launcher starts the ranks inside the trainer's Slurm job, and this process "
                             "runs in none (no SLURM_JOB_ID): run the trainer on a scheduler: slurm partition, or "
                             "use the local launcher")
        nodes = tuple(_slurm(["scontrol", "show", "hostnames", environ["SLURM_JOB_NODELIST"]]).split())
        per_node = environ.get("SLURM_NTASKS_PER_NODE", "")
        ranks_per_node = world // len(nodes)
        if ranks_per_node * len(nodes) != world or (per_node.isdigit() and int(per_node) != ranks_per_node):
            asked = f"{per_node} task(s) per node" if per_node.isdigit() else "its tasks"
            raise ValueError(
                f"tensor_parallel x data_parallel = {world} ranks, and the trainer's Slurm job {job_id} has "
                f"{len(nodes)} node(s) with {asked}: the ranks must fill every node alike, one per GPU; make "
                "tensor_parallel x data_parallel equal the trainer partition's nodes_per_worker x gpus_per_node")
        here = environ.get("SLURMD_NODENAME")
        if here and here != nodes[0]:
            raise ValueError(f"the Megatron backend runs on node {here}, not on the first node of its job "
                             f"({nodes[0]}), where rank 0 and the rendezvous are: run it in the job's batch step")
        cpus = environ.get("SLURM_CPUS_PER_TASK", "")
        return cls(job_id, nodes, ranks_per_node, int(cpus) if cpus.isdigit() else 1, node_addr(nodes[0]))


def node_addr(node: str) -> str:
    """``NodeAddr`` of ``node`` from ``scontrol show node`` (the node name when it has none)."""
    m = re.search(r"\bNodeAddr=(\S+)", _slurm(["scontrol", "show", "node", "-o", node]))
    return m.group(1) if m else node


def srun_command(alloc: Allocation, world: int, log_dir: Path, python: str, module: str) -> list[str]:
    """The ``srun`` argv of the ranks' job step: ``world`` tasks, ``ranks_per_node`` on each node
    in block order, every task's output appended to its own ``megatron-rank<r>.log`` (a restarted
    trainer's ranks keep the lost ones' logs), the whole step
    ended when one rank exits non-zero. The step gets the job's GPUs on each node (Slurm's
    default); each rank picks ``LOCAL_RANK``'s."""
    logs = str(log_dir).replace("%", "%%") + "/megatron-rank%t.log"
    return [
        "srun", f"--jobid={alloc.job_id}", f"--nodes={len(alloc.nodes)}", f"--ntasks={world}",
        f"--ntasks-per-node={alloc.ranks_per_node}", f"--cpus-per-task={alloc.cpus_per_rank}",
        "--distribution=block", "--kill-on-bad-exit=1", "--export=ALL", "--job-name=megatron-ranks",
        f"--output={logs}", f"--error={logs}", "--open-mode=append", python, "-m", module,
    ]


def cancel_step(step: str) -> None:
    """``scancel`` one job step (``job.step``), ignoring a failure: the caller kills srun next."""
    if re.fullmatch(r"\d+\.\d+", step):
        subprocess.run(["scancel", step], capture_output=True, timeout=_SLURM_TIMEOUT_S, check=False)


def _slurm(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=_SLURM_TIMEOUT_S, check=True).stdout
