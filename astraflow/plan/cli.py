"""``astraflow plan``: parses and checks the options, then calls ``planner.run_plan`` and prints
its report (``report``) or its JSON. Registered on the main command line by ``astraflow.cli``.
Ctrl-C (or SIGTERM or SIGHUP while a run is simulated) stops the plan, its simulated run included, and
exits with 130, as ``astraflow run`` does."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from astraflow.clibase import UserPath

#: the report's width when stdout is not a terminal (rich's default there, 80, would cut the tables)
PIPED_WIDTH = 200


class BadInput(click.ClickException):
    """Bad input: exit code 2 and one message that names the fix (as the main CLI's UserError)."""

    exit_code = 2


class Finite(click.FloatRange):
    """A `click.FloatRange` that also refuses ``nan`` and ``inf``: every float option here is a
    count of minutes, seconds, tokens or a fraction, and a non-finite one has no plan."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{rv} is not a finite number", param, ctx)
        return rv


@click.command("plan")
@click.argument("config", type=UserPath(dir_okay=False))
@click.option("--pool", "pools", multiple=True, metavar="KIND=GPUS",
              help="A rollout pool: GPUS engines of hardware KIND (h100, a100, cpu, or local: this machine's "
                   "engine, with --calibrate or --calibration). Repeatable.")
@click.option("--minutes", type=Finite(min=0, min_open=True), default=10.0, show_default=True,
              help="Simulated minutes of training (as many steps as a trainer that never waits takes).")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=8, show_default=True,
              help="GPUs (sim engines) per RaaS node.")
@click.option("--step-seconds", type=Finite(min=0, min_open=True), default=None,
              help="Trainer step time (default: see docs/sim.md).")
@click.option("--trainer", "trainer_gpus", default="h100=8", show_default=True, metavar="KIND=GPUS",
              help="Trainer GPUs (KIND h100 or a100), for a step time derived from the model's size.")
@click.option("--model-params", type=Finite(min=0, min_open=True), default=None,
              help="Model parameters (default: the model's config.json).")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=None,
              help="Mean prompt length in tokens (default: the calibration's, the sim workload's, else 128).")
@click.option("--response-tokens", type=Finite(min=0, min_open=True), default=None,
              help="Mean response length in tokens (default: the calibration's, the sim engine's length_mean, "
                   "else half of max_new_tokens).")
@click.option("--time-scale", type=Finite(min=0, min_open=True), default=None,
              help="Simulated seconds per real second (default: auto).")
@click.option("--wait-target", type=Finite(min=0, max=1, max_open=True), default=0.10, show_default=True,
              help="Trainer wait fraction at or below which the trainer counts as not waiting.")
@click.option("--search/--no-search", default=True, show_default=True,
              help="Search the pool sizes at which the trainer stops waiting (shorter runs).")
@click.option("--search-minutes", type=Finite(min=0, min_open=True), default=None,
              help="Simulated minutes of each search run (default: half of --minutes, at least one where "
                   "--minutes allows).")
@click.option("--max-trials", type=click.IntRange(min=1), default=6, show_default=True,
              help="Simulated runs of the search at most.")
@click.option("--calibrate", is_flag=True, help="Measure this machine's engine and trainer on the config's model.")
@click.option("--calibration", type=UserPath(dir_okay=False), default=None, help="A saved calibration (JSON).")
@click.option("--save-calibration", type=UserPath(dir_okay=False), default=None, help="Write the calibration here.")
@click.option("--workdir", type=UserPath(file_okay=False), default=None, help="Where the simulated runs go.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config value.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")
def plan(config: str, pools: tuple[str, ...], trainer_gpus: str, calibrate: bool, calibration: str | None,
         save_calibration: str | None, workdir: str | None, overrides: tuple[str, ...], as_json: bool,
         gpus_per_node: int, **opts: Any) -> None:
    """Simulate CONFIG on pools of hardware: throughput per pool and overall, trainer wait,
    staleness, dropped samples, then the pool sizes at which the trainer stops waiting."""
    from rich.console import Console
    from rich.markup import escape

    from astraflow.config import ConfigError, load_config
    from astraflow.plan.planner import Calibration, PlanOptions, check_save_path, check_workdir, run_plan
    from astraflow.plan.pools import TRAINER_PEAK_FLOPS, PlanError, parse_pool
    from astraflow.plan.report import print_report
    from astraflow.plan.simulate import SimFailed
    from astraflow.rollout.sim_config import PRESETS

    err = Console(stderr=True)
    try:
        if not pools:
            raise PlanError("give at least one --pool KIND=GPUS, e.g. --pool h100=64")
        kind, _, n = trainer_gpus.partition("=")
        if not n.isdigit() or int(n) < 1:
            raise PlanError(f"--trainer {trainer_gpus!r}: write KIND=GPUS, e.g. --trainer h100=8")
        if kind.lower() not in TRAINER_PEAK_FLOPS:
            raise PlanError(f"--trainer {trainer_gpus!r}: unknown trainer GPU kind {kind!r}; use one of "
                            f"{', '.join(TRAINER_PEAK_FLOPS)}")
        if calibrate and calibration:
            raise PlanError("--calibrate measures a calibration and --calibration loads a saved one: give one of them")
        if opts["search_minutes"] is not None and not opts["search"]:
            raise PlanError("--search-minutes sets the search's runs and --no-search skips the search: drop one")
        given = click.get_current_context().get_parameter_source("max_trials") is ParameterSource.COMMANDLINE
        if given and not opts["search"]:  # it has a default: only one the user typed is refused
            raise PlanError("--max-trials bounds the search's runs and --no-search skips the search: drop one")
        if save_calibration and not (calibrate or calibration):
            raise PlanError("--save-calibration writes the calibration: add --calibrate to measure one")
        for spec in pools:  # syntax and kinds before a calibration takes its seconds
            parse_pool(spec, gpus_per_node, PRESETS["cpu"] if calibrate or calibration else None)
        cfg = load_config(config, list(overrides))
        if save_calibration:  # where the results go, before a calibration or a run takes its time
            check_save_path(Path(save_calibration))
        if workdir:
            check_workdir(Path(workdir))
        cal = Calibration.load(Path(calibration)) if calibration else None
        if calibrate:
            from astraflow.plan.calibrate import calibrate as measure_local

            cal = measure_local(cfg, progress=lambda s: err.print(f"[dim]calibrate: {escape(s)}[/dim]"))
        if cal is not None and save_calibration:
            cal.save(Path(save_calibration))
        parsed = [parse_pool(p, gpus_per_node, cal.engine if cal else None) for p in pools]
        report = run_plan(cfg, parsed, PlanOptions(trainer=(kind.lower(), int(n)), calibration=cal,
                                                   workdir=Path(workdir) if workdir else None, **opts),
                          progress=lambda s: err.print(f"[dim]{escape(s)}[/dim]"))
    except (ConfigError, PlanError) as e:
        raise BadInput(str(e)) from None
    except SimFailed as e:
        raise click.ClickException(f"the simulation failed: {e}") from None
    except KeyboardInterrupt as e:  # the simulated run is stopped already (``simulate.run_sim``)
        from astraflow.runtime.stopping import ignore_stop_signals

        ignore_stop_signals()
        click.echo(f"plan: stopped{f' by {e}' if str(e) else ''}; no simulated run is left running", err=True)
        sys.exit(130)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        console = Console()
        print_report(report, console if console.is_terminal else Console(width=PIPED_WIDTH))
