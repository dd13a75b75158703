"""Dry run of the Slurm backend: print the worker job scripts and sbatch lines for a partition.

    python -m schedulers render partition.yaml --scheduler-address tcp://10.0.0.1:8786 --job-dir runs/x/jobs

Nothing is written or submitted. The partition file is a YAML/JSON mapping of `Partition` fields.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click


@click.group()
def main() -> None:
    """AstraFlow scheduler backends (no astraflow import needed)."""


@main.command()
@click.argument("partition_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--scheduler-address", required=True, help="tcp://host:port or the path of <run>/scheduler.json")
@click.option("--job-dir", required=True, type=click.Path(path_type=Path), help="where scripts and logs would go")
@click.option("--count", default=1, show_default=True, type=click.IntRange(min=1), help="how many workers")
@click.option("--start-index", default=0, show_default=True, type=click.IntRange(min=0),
              help="number of the first worker (the last field of its name)")
@click.option("--python", "python", default=sys.executable, show_default=True, help="interpreter on the compute nodes")
@click.option("--interface", default=None, help="network interface the workers listen on (e.g. ib0)")
@click.option("--setup-line", "setup_lines", multiple=True, help="shell line before the worker (module load ...)")
@click.option("--tag", default=None,
              help="the jobs' --comment, by which a run finds its jobs (default: the run's own when "
                   "--scheduler-address is a run's scheduler.json, else 'astraflow')")
@click.option("--tls", "tls_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="the run's security/tls.json (default: next to a scheduler file given as --scheduler-address)")
def render(partition_file, scheduler_address, job_dir, count, start_index, python, interface, setup_lines, tag,
           tls_file):
    """Print the job script(s) and the sbatch line(s); submit nothing. Workers of a run with TLS
    (the default) get its certificates, so they can join its scheduler."""
    import json

    import yaml
    from pydantic import ValidationError

    from schedulers.partition import Partition
    from schedulers.slurm import SlurmScheduler, run_tag
    from schedulers.tls import TLSFiles
    from storage.paths import RunPaths

    if tag is None:
        tag = run_tag(Path(scheduler_address).parent) if scheduler_address.endswith(".json") else "astraflow"

    if tls_file is None and scheduler_address.endswith(".json"):
        tls_file = RunPaths(Path(scheduler_address).parent).tls_record
        tls_file = tls_file if tls_file.exists() else None
    try:
        spec = yaml.safe_load(partition_file.read_text())
    except yaml.YAMLError as e:
        raise click.BadParameter(f"{partition_file} is not valid YAML: {e}") from None
    if not isinstance(spec, dict):
        raise click.BadParameter(f"{partition_file} must hold one partition as a mapping (name: ..., scheduler: "
                                 f"slurm, ...), not {type(spec).__name__}")
    try:
        partition = Partition(**spec)
        tls = TLSFiles.from_json(json.loads(tls_file.read_text())) if tls_file else None
        sched = SlurmScheduler(job_dir, python=python, interface=interface, setup_lines=setup_lines, tag=tag, tls=tls)
        for index in range(start_index, start_index + count):
            script, argv = sched.render(partition, scheduler_address, index)
            click.echo(script)
            click.echo(f"# would run: {shlex.join(argv)}\n")
    except (ValidationError, ValueError, KeyError, OSError) as e:
        raise click.BadParameter(f"{type(e).__name__}: {e}" if isinstance(e, (KeyError, OSError)) else str(e)) from e


if __name__ == "__main__":
    main()
