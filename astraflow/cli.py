"""The ``astraflow`` command line. Each command parses, validates, lazily imports and calls
one function; nothing here knows how a run works.

Choices, defaults and help of options that set a config field come from the config type that
owns the field (its ``Literal`` values, its default, its docstring), so the CLI and the config
never disagree.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import click
from pydantic import BaseModel

from astraflow.runtime.control import DEFAULT_REMOVAL, REMOVAL_HELP, REMOVAL_MODES
from astraflow.plan.cli import plan as plan_cli
from astraflow.sandbox.cli import sandbox as sandbox_cli
from astraflow.training.config import ModelInit
from schedulers.partition import Partition
from storage.ownership import owner_only
from storage.paths import RunPaths, default_run_dir

#: scheduler of a partition added to a running run when neither the options nor --from-yaml
#: name one (a pool that joins a running run is usually a Slurm partition)
ADD_SCHEDULER = "slurm"


class UserError(click.ClickException):
    """Bad input: exit code 2 and one message that names the fix, no traceback."""

    exit_code = 2


def _load(config: str, overrides: tuple[str, ...]):
    """The validated config, its existing model directories checked to load."""
    from astraflow.config import ConfigError, load_config
    from astraflow.preflight import check_devices, check_engine, check_models

    try:
        cfg = load_config(config, list(overrides))
        check_models(cfg)
        check_devices(cfg)
        check_engine(cfg)
        return cfg
    except ConfigError as err:
        raise UserError(str(err)) from None


def _default_run_dir(name: str) -> Path:
    import time

    return default_run_dir(name, time.strftime("%Y%m%d-%H%M%S"))


def _field(model: type[BaseModel], name: str, **overrides: Any) -> dict[str, Any]:
    """``click.option`` keywords for config field ``model.name``: its choices (a ``Literal``),
    its default and its docstring as help; ``overrides`` replace any of them."""
    f = model.model_fields[name]
    kw: dict[str, Any] = {"default": f.default, "show_default": f.default is not None,
                          "help": " ".join((f.description or "").replace("``", "`").split())}
    if get_origin(f.annotation) is Literal:
        kw["type"] = click.Choice(get_args(f.annotation))
    kw.update(overrides)
    return kw


def _choices(model: type[BaseModel], name: str) -> click.Choice:
    return click.Choice(get_args(model.model_fields[name].annotation))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """AstraFlow: dataflow-oriented RL for agentic LLMs.

    RaaS nodes, the data layer and one trainer per policy run as Dask actors, locally
    (the embedded default) or as Slurm jobs across partitions. Start with
    `astraflow run examples/math/config.yaml`.
    """
    _user_modules_from_cwd()


def _user_modules_from_cwd() -> None:
    """Put the working directory on the import path of this process and of every process it
    starts, as ``python -m`` does: a config's ``package.module:name`` (a user's workflow,
    workload or rule) then imports from where the command runs."""
    import os

    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if cwd not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([cwd, *parts])


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--run-dir", type=click.Path(file_okay=False), help="Run directory (default: runs/<name>-<time>).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config value, e.g. --set run.max_steps=20 (repeatable).")
@click.option("--quiet", is_flag=True, help="No progress output.")
def run(config: str, run_dir: str | None, overrides: tuple[str, ...], quiet: bool) -> None:
    """Train with CONFIG (a YAML file) until every trainer has taken run.max_steps steps.

    Prints the Dask dashboard address, progress while it trains, and writes config.yaml,
    metrics.jsonl, summary.json, the trajectory store, the weight store and logs into the run
    directory. Ctrl-C (or SIGTERM, scancel) stops cleanly without losing what was written and
    exits with 130; SIGUSR1 (the head job's walltime warning) stops the same way and exits with
    75 (the head job then requeues); a failed run exits with 1 and its reason in one line.
    summary.json records how the run ended and the worker jobs are cancelled. Run again on the
    directory to resume it (jobs a previous incarnation left are cancelled first).
    """
    click.get_current_context().with_resource(owner_only())  # inherited by the processes it starts
    cfg = _load(config, overrides)
    from astraflow.runtime.launch import launch
    from astraflow.runtime.stopping import ignore_stop_signals
    from astraflow.runtime.stopping import REQUEUE_EXIT_CODE, StopForRequeue, disk_full, disk_full_reason
    from astraflow.runtime.workers import RunFailed
    from astraflow.training.numerics import NonFiniteError

    rd = Path(run_dir) if run_dir else _default_run_dir(cfg.run.name)
    try:
        result = launch(cfg, rd, quiet=quiet)
    except StopForRequeue as sig:  # before the run started: nothing to stop, resumed all the same
        click.echo(f"stopped by {sig.args[0]} for a requeue before the run started; run again on {rd}", err=True)
        sys.exit(REQUEUE_EXIT_CODE)
    except ValueError as err:
        raise UserError(str(err)) from None
    except (RunFailed, NonFiniteError) as err:  # the run started and failed: exit 1, its reason
        raise click.ClickException(f"the run failed: {err}") from None
    except OSError as err:  # a full disk before the run got going (lock, config, models)
        if not disk_full(err):
            raise
        raise click.ClickException(f"the run failed: {disk_full_reason(err, rd)}") from None
    if result.interrupted:
        click.echo(f"the run was {result.ending.reason}; summary in {RunPaths(result.run_dir).summary}; "
                   "run again on this directory to resume it", err=True)
        ignore_stop_signals()
        sys.exit(REQUEUE_EXIT_CODE if result.ending.requeue else 130)


@main.group()
def model() -> None:
    """Build models locally (no downloads)."""


@model.command("init")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--preset", **_field(ModelInit, "preset"))
@click.option("--arch", **_field(ModelInit, "arch"))
@click.option("--seed", type=int, **_field(ModelInit, "seed"))
@click.option("--tie-embeddings/--untie-embeddings", **_field(ModelInit, "tie_embeddings"))
@click.option("--warm-start-seconds", type=float, **_field(ModelInit, "warm_start_seconds"))
@click.option("--warm-start-steps", type=int, **_field(
    ModelInit, "warm_start_steps",
    help="Upper bound of the warm start in optimiser steps (1 or more). Unset: no bound in steps (the warm start "
         "then runs for --warm-start-seconds, and not at all when that is 0). Given alone, the warm start runs this "
         "many steps with no time bound; the warm start is seeded, so a bound in steps builds the same model on a "
         "fast and a slow machine. With several bounds the first reached stops it."))
@click.option("--warm-start-lr", type=float, **_field(ModelInit, "warm_start_lr"))
def model_init(out: str, preset: str, arch: str, seed: int, tie_embeddings: bool, warm_start_seconds: float,
               warm_start_steps: int | None, warm_start_lr: float) -> None:
    """Build a tiny Qwen2/Llama model with a local byte-level tokenizer into OUT (HF format).

    The warm start trains on the math workload's train split."""
    from pydantic import ValidationError

    from astraflow.configerrors import option_errors
    from astraflow.preflight import unbuildable
    from astraflow.runtime.launch import ModelDirError, build_model

    try:
        init = ModelInit(preset=preset, arch=arch, seed=seed, tie_embeddings=tie_embeddings,
                         warm_start_seconds=warm_start_seconds, warm_start_steps=warm_start_steps,
                         warm_start_lr=warm_start_lr)
    except ValidationError as err:
        raise UserError(option_errors(err)) from None
    if Path(out).is_dir() and any(Path(out).iterdir()):
        raise UserError(f"{out} exists and is not empty: choose a new directory")
    why = None if Path(out).is_dir() else unbuildable(Path(out))
    if why:
        raise UserError(f"OUT {out} cannot be created: {why}; choose a directory that can be created")
    try:
        build_model(Path(out), init)
    except ModelDirError as err:
        raise UserError(f"OUT {err}") from None


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config value as `astraflow run` would, e.g. --set run.max_steps=20 (repeatable; "
                   "VALUE is YAML, list elements are named: --set policies.solver.trainer.lr=1e-4).")
def check(config: str, overrides: tuple[str, ...]) -> None:
    """Validate CONFIG and print the resolved configuration, then (on stderr) what each
    partition's workers run with (engines per RaaS node, the settings a partition changes) and
    read the workload's data as a run would and say what it found (a dataset's bad rows listed
    by file and line)."""
    import yaml

    cfg = _load(config, overrides)
    click.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    from astraflow.partition_settings import plan_lines
    from astraflow.runtime.launch import check_data

    for line in plan_lines(cfg.partitions, cfg.rollout, {p.name: p.trainer for p in cfg.policies}):
        click.echo(line, err=True)

    try:
        click.echo(check_data(cfg.workload), err=True)
    except ValueError as err:
        raise UserError(str(err)) from None


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True,
              help="Machine-readable output: the same view as the dashboard's /astraflow/api/status.json "
                   "(also for a finished run).")
@click.option("--metrics", is_flag=True,
              help="With --json: the curves of metrics.jsonl instead (/astraflow/api/metrics.json).")
def status(run_dir: str, as_json: bool, metrics: bool) -> None:
    """Status of the run in RUN_DIR: components, partitions, versions, throughput; for a run that
    has finished, its final state (how it ended, the steps taken, its ledger) from summary.json."""
    if metrics and not as_json:
        raise UserError("--metrics goes with --json (for pictures of the curves use `astraflow plot RUN_DIR`)")
    if as_json:
        from astraflow.runtime.monitoring import build_status_view, read_metrics

        if metrics:
            if not RunPaths(run_dir).metrics.exists():
                raise UserError(f"{run_dir} has no metrics.jsonl: pass the --run-dir of a run that started")
            click.echo(read_metrics(Path(run_dir)).model_dump_json(indent=2))
            return
        try:
            view = build_status_view(Path(run_dir))
        except ValueError as err:
            raise UserError(str(err)) from None
        click.echo(view.model_dump_json(indent=2))
        return
    from astraflow.runtime.monitoring import RunNotRunning, format_status, read_snapshot, run_status
    from astraflow.runtime.monitoring.text import format_summary

    try:
        st = run_status(Path(run_dir))
    except RunNotRunning as err:  # a finished run has its final state to show; any other is an error
        try:
            snap = read_snapshot(Path(run_dir)) if Path(run_dir).is_dir() else None
        except ValueError as damaged:  # a damaged summary.json (named, with the fix)
            raise UserError(str(damaged)) from None
        if snap is None or snap.summary is None:
            raise UserError(str(err)) from None
        click.echo(format_summary(snap.summary, str(snap.paths.summary)))
        return
    except ValueError as err:  # a damaged status file (named, with the fix)
        raise UserError(str(err)) from None
    click.echo(format_status(st))


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--out", type=click.Path(file_okay=False), help="Output directory (default: RUN_DIR/plots).")
def plot(run_dir: str, out: str | None) -> None:
    """Write PNG plots of RUN_DIR's metrics.jsonl: reward, held-out accuracy, throughput, staleness."""
    from astraflow.runtime.monitoring import write_plots

    try:
        paths = write_plots(Path(run_dir), Path(out) if out else None)
    except ValueError as err:
        raise UserError(str(err)) from None
    for p in paths:
        click.echo(str(p))


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--logdir", type=click.Path(file_okay=False), help="Event file directory (default: RUN_DIR/tensorboard).")
@click.option("--follow", is_flag=True, help="Keep mirroring new lines until the run ends.")
def tensorboard(run_dir: str, logdir: str | None, follow: bool) -> None:
    """Mirror RUN_DIR's metrics.jsonl into TensorBoard event files (needs `pip install tensorboard`)."""
    from astraflow.runtime.monitoring import export_tensorboard

    try:
        n = export_tensorboard(Path(run_dir), Path(logdir) if logdir else None, follow=follow)
    except ValueError as err:
        raise UserError(str(err)) from None
    except (FileNotFoundError, NotADirectoryError, PermissionError, FileExistsError) as err:
        raise UserError(f"--logdir {logdir or RunPaths(run_dir).tensorboard}: the event files cannot be written "
                        f"there ({err.strerror or err}); pass a --logdir you can write to") from None
    click.echo(f"{n} metrics lines written to {logdir or RunPaths(run_dir).tensorboard}")


# -- partitions of a running run -----------------------------------------------------------------
# These commands change a run only by writing its desired partitions (control/partitions.json);
# the orchestrator reconciles them on its next tick and reports the outcome in status.json.


@main.group()
@click.pass_context
def partitions(ctx: click.Context) -> None:
    """List, add and remove worker partitions of a running run (found through its RUN_DIR)."""
    ctx.with_resource(owner_only())


@partitions.command("list")
@click.argument("run_dir", type=click.Path(file_okay=False))
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
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.argument("name", required=False)
@click.option("--from-yaml", "from_yaml", type=click.Path(dir_okay=False),
              help="A YAML mapping of Partition fields (options given here override it).")
@click.option("--scheduler", type=_choices(Partition, "scheduler"), default=None, help=f"[default: {ADD_SCHEDULER}]")
@click.option("--slurm-partition", default=None, help="Slurm partition (sbatch --partition).")
@click.option("--nodes", type=int, default=None,
              help=f"Workers (one Slurm job, one node each). [default: {Partition.model_fields['nodes'].default}]")
@click.option("--cpus-per-node", type=int, **_field(Partition, "cpus_per_node", default=None, show_default=False))
@click.option("--gpus-per-node", type=int, **_field(Partition, "gpus_per_node", default=None, show_default=False))
@click.option("--gres", default=None, help="Slurm GRES per node, e.g. gpu:h100:4.")
@click.option("--mem", default=None, help="Memory per node, e.g. 16G.")
@click.option("--walltime", default=None, help="Slurm time limit, e.g. 04:00:00.")
@click.option("--region", **_field(Partition, "region", default=None, show_default=False))
@click.option("--hardware", default=None, help="Hardware label in worker names, e.g. H100.")
@click.option("--role", type=_choices(Partition, "role"), default=None,
              help=f"Only rollout pools can join a running run.  [default: {Partition.model_fields['role'].default}]")
@click.option("--sbatch-option", "sbatch_options", multiple=True, metavar="--OPT=VALUE",
              help="Extra #SBATCH line, e.g. --sbatch-option=--account=proj (repeatable).")
@click.option("--wait", "wait_s", type=float, default=20.0, show_default=True,
              help="Seconds to wait for the orchestrator to submit the jobs (0: do not wait).")
def partitions_add(run_dir: str, name: str | None, from_yaml: str | None, wait_s: float, **fields) -> None:
    """Add partition NAME to the running run in RUN_DIR.

    The orchestrator submits its worker jobs on its next tick and starts a RaaS node on every
    worker that joins (after a weight catch-up). If sbatch refuses the jobs, this command
    says why, withdraws the partition (the run is unaffected) and exits with 2.
    """
    import yaml
    from pydantic import ValidationError

    from astraflow.configerrors import bool_problems, load_yaml, partition_errors
    from astraflow.runtime.control import add_partition, remove_partition, wait_partition

    data: dict = {}
    if from_yaml:
        try:
            data = load_yaml(Path(from_yaml).read_bytes().decode("utf-8")) or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
            raise UserError(f"--from-yaml {from_yaml}: {err}") from None
        if not isinstance(data, dict):
            raise UserError(f"--from-yaml {from_yaml}: write a mapping of partition fields (name, scheduler, nodes, ...)")
    if name:
        data["name"] = name
    if "name" not in data:
        raise UserError("give the partition NAME (or a `name:` in --from-yaml)")
    data.setdefault("scheduler", ADD_SCHEDULER)
    for key, value in fields.items():
        if value is not None and value != ():
            data[key] = list(value) if key == "sbatch_options" else value
    bools = bool_problems(data, Partition)  # `nodes: true` would be taken as 1
    try:
        part = Partition(**data)
    except ValidationError as err:
        raise UserError(partition_errors(err, bools)) from None
    if bools:
        raise UserError(partition_errors(None, bools))
    try:
        add_partition(Path(run_dir), part)
    except ValueError as err:  # RunNotRunning, PartitionError, a damaged file of the run
        raise UserError(str(err)) from None
    click.echo(f"partition {part.name} requested: {part.nodes} {part.scheduler} worker(s)"
               + (f" in Slurm partition {part.slurm_partition}" if part.slurm_partition else ""))
    if wait_s <= 0:
        return
    try:
        entry = wait_partition(Path(run_dir), part.name, wait_s, until="submitted")
    except TimeoutError as err:
        click.echo(f"warning: {err}", err=True)
        return
    except ValueError as err:
        raise UserError(str(err)) from None
    if entry.get("error"):
        remove_partition(Path(run_dir), part.name, "now")  # withdraw at once: it has no worker yet
        raise UserError(f"partition {part.name} was refused: {entry['error']}\n"
                        "it was withdrawn; the run is unaffected. Fix the options and add it again")
    jobs = ", ".join(f"{j} ({s})" for j, s in entry.get("jobs", {}).items())
    click.echo(f"submitted: {jobs}")


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
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.argument("name")
@_removal_modes
@click.option("--wait", "wait_s", type=float, default=0.0, show_default=True,
              help="Seconds to wait until the partition is removed (0: do not wait).")
def partitions_remove(run_dir: str, name: str, mode: str, wait_s: float) -> None:
    """Remove partition NAME from the running run in RUN_DIR (give one of --drain, --now). No
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


main.add_command(sandbox_cli)  # astraflow sandbox run PROGRAM [--tests FILE]: see docs/sandbox.md
main.add_command(plan_cli)  # astraflow plan CONFIG --pool KIND=GPUS: see docs/sim.md

if __name__ == "__main__":
    main()
