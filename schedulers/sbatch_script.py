"""The job script of a Slurm worker and the ``sbatch`` argv that submits it.

The script is rendered from ``templates/worker.sbatch.j2``. Every value in it that comes from
the config or the filesystem is either validated to a plain character set (worker and partition
names, the tag, resources, extra sbatch options) or shell-quoted (``export`` values and the
worker command). `setup_lines` are the exception: they are shell the run's owner writes
(``cluster.slurm_setup_lines``) and run as written.

A trainer partition with ``nodes_per_worker`` > 1 gets a job of that many nodes with one task
per GPU (``--ntasks-per-node``, the node's CPUs shared among them): the batch script, and so the
Dask worker, still runs once, on the first node; the Megatron backend starts its ranks as an
``srun`` step of the job.

The log path is given to sbatch on its command line (``--output``/``--error``), not in an
``#SBATCH`` line: sbatch parses those lines itself, splitting at blanks and giving quotes and
``\\`` their own meaning, while an argv element reaches it unparsed, whatever the run directory
is called.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

import jinja2

from schedulers.partition import Partition

TEMPLATE_DIR = Path(__file__).parent / "templates"
WORKER_TEMPLATE = "worker.sbatch.j2"

#: what a worker name may be made of (it becomes part of the job name and of file names)
_WORKER_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
#: the longest job name a worker job gets: Slurm's accounting keeps a job name in 255 bytes at most
JOB_NAME_MAX = 200
#: characters a job directory may not contain: control characters would end a script line, and
#: a backslash turns off Slurm's ``%j`` replacement in file names
_BAD_DIR_CHARS = re.compile(r"[\x00-\x1f\x7f\\]")


def environment() -> jinja2.Environment:
    """The Jinja environment of the job templates, with the ``shquote`` filter."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["shquote"] = lambda s: shlex.quote(str(s))
    return env


def check_job_dir(job_dir: str | Path) -> Path:
    """`job_dir` as an absolute path, or ValueError when Slurm could not use it for log files."""
    path = Path(job_dir).absolute()
    if _BAD_DIR_CHARS.search(str(path)):
        raise ValueError(f"job directory {str(path)!r} has a control character or a backslash: Slurm cannot "
                         "name log files in it; choose a run directory without them")
    return path


def job_name(worker: str, tag: str) -> str:
    """The Slurm job name of worker `worker` of the run tagged `tag`: ``<worker>.<tag>``, so that
    ``squeue`` tells apart the workers of several runs of one user (each run has workers of the
    same names), and ``squeue --name`` finds one run's worker. Characters other than letters,
    digits, ``_``, ``.`` and ``-`` become ``_``; the tag is cut so the name stays within
    `JOB_NAME_MAX`."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", tag)
    return f"{worker}.{safe}"[:JOB_NAME_MAX]


def worker_of_job(name: str, tag: str) -> str:
    """The worker name in job name `name` of the run tagged `tag` (`job_name`'s inverse); a name
    without the run's suffix (a job submitted before job names carried it) is the worker's."""
    for worker in (name.rsplit(".", n)[0] for n in range(1, name.count(".") + 1)):
        if job_name(worker, tag) == name:
            return worker
    return name


def log_pattern(job_dir: Path, name: str) -> str:
    """The sbatch ``--output`` file name of worker `name`: ``<job_dir>/<name>.%j.log``, with any
    ``%`` of the directory doubled so Slurm keeps it as written."""
    return f"{str(job_dir).replace('%', '%%')}/{name}.%j.log"


def render_worker_job(
    template: jinja2.Template,
    partition: Partition,
    name: str,
    *,
    job_dir: Path,
    tag: str,
    setup_lines: Sequence[str],
    env: Mapping[str, str],
    command: Sequence[str],
) -> tuple[str, list[str]]:
    """The job script of worker `name` of `partition` and the argv that submits it (the script
    is written to ``<job_dir>/<name>.sbatch``, the argv's last element)."""
    if not _WORKER_NAME.fullmatch(name):
        raise ValueError(f"worker name {name!r}: use letters, digits, '_', '.' and '-'")
    gres = partition.gres or (f"gpu:{partition.gpus_per_node}" if partition.gpus_per_node else None)
    log = log_pattern(job_dir, name)
    script = template.render(
        partition=partition,
        worker_name=name,
        job_name=job_name(name, tag),
        gres=gres,
        cpus_per_rank=max(partition.cpus_per_node // partition.ranks_per_node, 1),
        log=str(job_dir / f"{name}.%j.log"),
        tag=tag,
        setup_lines=tuple(setup_lines),
        env=sorted(env.items()),
        command=list(command),
    )
    return script, ["sbatch", "--parsable", f"--output={log}", f"--error={log}", str(job_dir / f"{name}.sbatch")]
