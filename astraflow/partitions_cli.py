"""``astraflow partitions list/add/remove``: the worker partitions of a running run.

These commands change a run only by writing its desired partitions (``control/partitions.json``);
the orchestrator reconciles them on its next tick and reports the outcome in ``status.json``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import click

from astraflow.clibase import Seconds, UserError, UserPath, choices, field_option, shell_arg
from astraflow.runtime.control import DEFAULT_REMOVAL, REMOVAL_HELP, REMOVAL_MODES
from schedulers.partition import Partition
from storage.ownership import owner_only
from storage.paths import RunPaths

#: scheduler of a partition added to a running run when neither the options nor --from-yaml
#: name one (a pool that joins a running run is usually a Slurm partition)
ADD_SCHEDULER = "slurm"
#: a partition's settings that only a Slurm partition has
SLURM_ONLY = ("slurm_partition", "gres", "sbatch_options", "walltime")


@click.group()
@click.pass_context
def partitions(ctx: click.Context) -> None:
    """List, add and remove worker partitions of a running run (found through its RUN_DIR)."""
    ctx.with_resource(owner_only())


@partitions.command("list")
@click.argument("run_dir", type=UserPath(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def partitions_list(run_dir: str, as_json: bool) -> None:
    """The partitions of the run: desired size, live and serving workers, jobs, throughput."""
    from astraflow.runtime.monitoring import format_partitions, run_status

    try:
        st = run_status(Path(run_dir))
    except ValueError as err:  # RunNotRunning, or a damaged status file
        raise UserError(str(err)) from None
    if as_json:
        click.echo(json.dumps(st.get("partitions", {}), indent=2, default=str))
    else:
        click.echo(format_partitions(st))


@partitions.command("add")
@click.argument("run_dir", type=UserPath(file_okay=False))
@click.argument("name", required=False)
@click.option("--from-yaml", "from_yaml", type=UserPath(dir_okay=False),
              help="A YAML mapping of Partition fields (options given here override it).")
@click.option("--scheduler", type=choices(Partition, "scheduler"), default=None,
              help="What starts the workers: local processes on the run's host, or Slurm jobs.  [default: the "
                   f"scheduler of the run's rollout partitions where they all have one, else {ADD_SCHEDULER}]")
@click.option("--slurm-partition", default=None, help="Slurm partition (sbatch --partition).")
@click.option("--nodes", type=int, default=None,
              help=f"Workers (one Slurm job, one node each). [default: {Partition.model_fields['nodes'].default}]")
@click.option("--cpus-per-node", type=int, **field_option(Partition, "cpus_per_node", default=None, show_default=False))
@click.option("--gpus-per-node", type=int, **field_option(Partition, "gpus_per_node", default=None, show_default=False))
@click.option("--gres", default=None, help="Slurm GRES per node, e.g. gpu:h100:4.")
@click.option("--mem", default=None, help="Memory per node, e.g. 16G.")
@click.option("--walltime", default=None, help="Slurm time limit, e.g. 04:00:00.")
@click.option("--region", **field_option(Partition, "region", default=None, show_default=False))
@click.option("--hardware", **field_option(Partition, "hardware", default=None, show_default=False))
@click.option("--role", type=choices(Partition, "role"), default=None,
              help=f"Only rollout pools can join a running run.  [default: {Partition.model_fields['role'].default}]")
@click.option("--sbatch-option", "sbatch_options", multiple=True, metavar="--OPT=VALUE",
              help="Extra #SBATCH line, e.g. --sbatch-option=--account=proj (repeatable).")
@click.option("--wait", "wait_s", type=Seconds(), default=20.0, show_default=True,
              help="Seconds to wait for what --until names (0: do not wait).")
@click.option("--until", type=click.Choice(["submitted", "serving"]), default="submitted", show_default=True,
              help="What --wait waits for: the worker jobs submitted, or a RaaS node serving on one of the "
                   "partition's workers (a Slurm queue can take long: give --wait room).")
def partitions_add(run_dir: str, name: str | None, from_yaml: str | None, wait_s: float, until: str,
                   **fields) -> None:
    """Add partition NAME to the running run in RUN_DIR.

    The orchestrator submits its worker jobs on its next tick and starts a RaaS node on every
    worker that joins (after a weight catch-up). If sbatch refuses the jobs, or with
    `--until serving` its workers fail before one serves, this command says why, withdraws the
    partition (the run is unaffected) and exits with 2. With `--until serving`, a partition not
    serving within --wait exits with 1 (it stays requested).
    """
    from astraflow.runtime.control import add_partition

    part = _partition_from(name, from_yaml, fields, _run_scheduler(Path(run_dir)))
    try:
        add_partition(Path(run_dir), part)
    except ValueError as err:  # RunNotRunning, PartitionError, a damaged file of the run
        raise UserError(str(err)) from None
    click.echo(f"partition {part.name} requested: {part.nodes} {part.scheduler} worker(s)"
               + (f" in Slurm partition {part.slurm_partition}" if part.slurm_partition else ""))
    if part.nodes == 0:  # nothing will be submitted: nothing to wait for
        click.echo("it has no worker to start (--nodes 0): nothing to wait for")
        return
    if wait_s > 0:
        _wait_for_added(Path(run_dir), part, wait_s, until)


def _run_scheduler(run_dir: Path) -> str:
    """The scheduler of the run's rollout partitions where they all have the same (an embedded
    run's ``local``), else ``ADD_SCHEDULER``."""
    from astraflow.runtime.control import read_desired_file

    try:
        parts, _ = read_desired_file(RunPaths(run_dir))
    except (OSError, ValueError):  # not a run, or its file damaged: add_partition says so
        return ADD_SCHEDULER
    kinds = {p.scheduler for p in parts.values() if p.role == "rollout"}
    return kinds.pop() if len(kinds) == 1 else ADD_SCHEDULER


def _partition_from(name: str | None, from_yaml: str | None, fields: dict, scheduler: str) -> Partition:
    """The partition to add: ``--from-yaml``'s fields, then NAME and the options given on the
    command line over them (``scheduler`` where none names one); invalid fields are a
    `UserError` naming each."""
    import yaml
    from pydantic import ValidationError

    from astraflow.configerrors import bool_problems, load_yaml, partition_errors, yaml_problem

    data: dict = {}
    if from_yaml:
        try:
            data = load_yaml(Path(from_yaml).read_bytes().decode("utf-8")) or {}
        except yaml.YAMLError as err:
            raise UserError(f"--from-yaml {from_yaml}: not valid YAML at {yaml_problem(err)}") from None
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"--from-yaml {from_yaml}: {err}") from None
        if not isinstance(data, dict):
            raise UserError(f"--from-yaml {from_yaml}: write a mapping of partition fields "
                            "(name, scheduler, nodes, ...)")
    if name:
        data["name"] = name
    if "name" not in data:
        raise UserError("give the partition NAME (or a `name:` in --from-yaml)")
    given = {key for key, value in fields.items() if value is not None and value != ()}
    for key in given:
        data[key] = list(fields[key]) if key == "sbatch_options" else fields[key]
    if "scheduler" not in data:  # options only Slurm has name it
        data["scheduler"] = "slurm" if any(data.get(k) not in (None, (), []) for k in SLURM_ONLY) else scheduler
    bools = bool_problems(data, Partition)  # `nodes: true` would be taken as 1
    try:
        part = Partition(**data)
    except ValidationError as err:
        raise UserError(partition_errors(err, bools, given, Partition)) from None
    if bools:
        raise UserError(partition_errors(None, bools))
    return part


def _wait_for_added(run_dir: Path, part: Partition, wait_s: float, until: str) -> None:
    """Wait up to ``wait_s`` for the added partition's jobs to be submitted or (``until``
    serving) to serve, and say so. Jobs sbatch refused, or workers that failed before serving,
    withdraw the partition and are a `UserError`; no answer in time is a warning (submitted) or
    exit 1 (serving)."""
    from astraflow.runtime.control import remove_partition, wait_partition

    try:
        entry = wait_partition(run_dir, part.name, wait_s, until=until)
    except TimeoutError as err:
        if until == "serving":  # asked to know it serves: not knowing is a failure
            raise click.ClickException(str(err)) from None
        click.echo(f"warning: {err}", err=True)
        return
    except ValueError as err:
        raise UserError(str(err)) from None
    if entry.get("error"):
        what = "failed" if entry.get("jobs") else "was refused"
        try:  # withdraw at once: none of its workers serves
            remove_partition(run_dir, part.name, "now", keep_one=False)
        except ValueError as err:  # the run ended meanwhile, its files locked or damaged
            raise UserError(f"partition {part.name} {what}: {entry['error']}\n"
                            f"withdrawing it failed too: {err}") from None
        raise UserError(f"partition {part.name} {what}: {entry['error']}\n"
                        "it was withdrawn; the run is unaffected. Fix the options and add it again")
    jobs = ", ".join(f"{j} ({s})" for j, s in entry.get("jobs", {}).items())
    if until == "submitted":
        click.echo(f"submitted: {jobs}\n(its workers may still fail to start: `astraflow status {shell_arg(run_dir)}` "
                   "shows the partition's state; `--until serving` waits until one serves)")
    else:
        click.echo(f"serving: {entry.get('serving', 0)} of {part.nodes} worker(s) (jobs: {jobs or 'none'})")


def _removal_modes(command):
    """One flag per removal mode (``--drain``, ``--now``), passed to ``command`` as ``mode``; two
    of them together are refused (click would silently keep the last one given)."""
    @functools.wraps(command)
    def with_mode(*args, **kwargs):
        given = [m for m in REMOVAL_MODES if kwargs.pop(f"removal_{m}")]
        if len(given) > 1:
            raise UserError(" and ".join(f"--{m}" for m in given) + " conflict: give one of them ("
                            + "; ".join(f"--{m}: {REMOVAL_HELP[m]}" for m in given) + ")")
        return command(*args, mode=given[0] if given else DEFAULT_REMOVAL, **kwargs)

    with_mode.__click_params__ = list(getattr(command, "__click_params__", []))
    for mode in reversed(REMOVAL_MODES):
        default = " [default]" if mode == DEFAULT_REMOVAL else ""
        with_mode = click.option(f"--{mode}", f"removal_{mode}", is_flag=True,
                                 help=REMOVAL_HELP[mode].capitalize() + default + ".")(with_mode)
    return with_mode


@partitions.command("remove")
@click.argument("run_dir", type=UserPath(file_okay=False))
@click.argument("name")
@_removal_modes
@click.option("--wait", "wait_s", type=Seconds(), default=0.0, show_default=True,
              help="Seconds to wait until the partition is removed (0: do not wait).")
def partitions_remove(run_dir: str, name: str, mode: str, wait_s: float) -> None:
    """Remove partition NAME from the running run in RUN_DIR: --drain (the default) or --now. No
    task is lost either way."""
    from astraflow.runtime.control import remove_partition, wait_partition

    try:
        remove_partition(Path(run_dir), name, mode)
    except ValueError as err:  # RunNotRunning, PartitionError, a damaged file of the run
        raise UserError(str(err)) from None
    click.echo(f"partition {name}: removal requested ({mode})")
    if wait_s > 0:
        try:
            entry = wait_partition(Path(run_dir), name, wait_s, until="removed")
        except TimeoutError as err:
            click.echo(f"warning: {err}", err=True)
            return
        except ValueError as err:
            raise UserError(str(err)) from None
        click.echo(f"partition {name} removed in {entry.get('drain_seconds') or 0:.1f}s")
