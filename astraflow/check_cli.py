"""``astraflow check CONFIG``: what ``astraflow run`` would check before it starts, without
starting anything: the resolved config, each partition's plan, the workload's data, the sandbox
and an agentic environment's conformance. ``load_checked_config`` is the config as both
commands take it."""

from __future__ import annotations

import click

from astraflow.clibase import UserError, UserPath
from storage.ownership import UnsafeDir


def load_checked_config(config: str, overrides: tuple[str, ...]):
    """The validated config, its existing model directories checked to load, its Slurm
    partitions checked to exist (where Slurm answers), and an external trajectory store checked
    to be the user's alone."""
    from astraflow.config import ConfigError, load_config
    from astraflow.preflight import check_devices, check_engine, check_models, check_slurm_partitions

    try:
        cfg = load_config(config, list(overrides))
        check_models(cfg)
        check_devices(cfg)
        check_engine(cfg)
        check_slurm_partitions(cfg)
        if cfg.storage.trajectories:  # a store outside the run directory (the run trains from it) is ours alone
            from storage.trajectories.locations import check_store_url

            check_store_url(cfg.storage.trajectories)
        return cfg
    except (ConfigError, UnsafeDir) as err:
        raise UserError(str(err)) from None
    except OSError as err:  # a store path that cannot be looked at
        raise UserError(f"storage.trajectories: {err}") from None


@click.command("check")
@click.argument("config", type=UserPath(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config value as `astraflow run` would, e.g. --set run.max_steps=20 (repeatable; "
                   "VALUE is YAML, list elements are named: --set policies.solver.trainer.lr=1e-4).")
def check(config: str, overrides: tuple[str, ...]) -> None:
    """Validate CONFIG and print the resolved configuration, then (on stderr) what each
    partition's workers run with (engines per RaaS node, the settings a partition changes) and
    read the workload's data as a run would and say what it found (a dataset's bad rows listed
    by file and line); an agentic workload's environment is run through the conformance suite."""
    import yaml

    cfg = load_checked_config(config, overrides)
    click.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    from astraflow.partition_settings import plan_lines
    from astraflow.runtime.launch import check_data, check_environment_of, check_sandbox

    for line in plan_lines(cfg.partitions, cfg.rollout, {p.name: p.trainer for p in cfg.policies}):
        click.echo(line, err=True)

    try:
        click.echo(f"reading the data of workload {cfg.workload.name} ...", err=True)  # minutes for millions of rows
        click.echo(check_data(cfg.workload, cfg), err=True)
        check_sandbox(cfg)  # as `run` checks it: a reward that runs code needs a working sandbox
        if (conforms := check_environment_of(cfg, lambda line: click.echo(line, err=True))) is not None:
            click.echo(conforms, err=True)
    except ValueError as err:
        raise UserError(str(err)) from None
