"""The ``astraflow`` command line. Each command parses, validates, lazily imports and calls
one function; nothing here knows how a run works.

Choices, defaults and help of options that set a config field come from the config type that
owns the field (its ``Literal`` values, its default, its docstring), so the CLI and the config
never disagree.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import click

from astraflow.check_cli import check as check_cli, load_checked_config
from astraflow.clibase import UserError, UserPath, field_option, open_standard_streams, shell_arg
from astraflow.episodes_cli import episodes as episodes_cli
from astraflow.export_cli import export as export_cli
from astraflow.partitions_cli import partitions as partitions_cli
from astraflow.plan.cli import plan as plan_cli
from astraflow.sandbox.cli import sandbox as sandbox_cli
from astraflow.stop_cli import stop as stop_cli
from astraflow.training.config import ModelInit
from storage.ownership import USER_DIR_ENV, add_user_dir, check_owner_only, owner_only
from storage.paths import RunPaths, default_run_dir


def _default_run_dir(name: str) -> Path:
    """``runs/<name>-<time>``, claimed at once (made, empty): a run started in the same second
    gets ``-2``, ``-3``, ... instead of sharing, or resuming, the other's directory."""
    import time

    base = default_run_dir(name, time.strftime("%Y%m%d-%H%M%S"))
    base.parent.mkdir(parents=True, exist_ok=True)
    check_owner_only(base)  # ``runs/``, which another user may have made, and the directories above it
    n = 1
    while True:
        rd = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            rd.mkdir()
            return rd
        except FileExistsError:
            n += 1


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.pass_context
def main(ctx: click.Context) -> None:
    """AstraFlow: dataflow-oriented RL for agentic LLMs.

    RaaS nodes, the data layer and one trainer per policy run as Dask actors, locally
    (the embedded default) or as Slurm jobs across partitions. Start with
    `astraflow run examples/math/config.yaml`.
    """
    open_standard_streams()
    ctx.with_resource(_user_modules_from_cwd())


@contextlib.contextmanager
def _user_modules_from_cwd() -> Iterator[None]:
    """Let a config's ``package.module:name`` (a user's workflow, workload or rule) import from
    the working directory, in this process and in every process it starts, without anything
    there shadowing an installed module: the directory goes at the end of ``sys.path``, and only
    if no other user can change it (``storage.ownership.add_user_dir``). The processes started
    get it in ``ASTRAFLOW_USER_DIR`` (their entry points append it the same way), not in
    ``PYTHONPATH`` (whose entries come first), and ``PYTHONSAFEPATH`` so that ``python -m`` does
    not put their working directory first either. Undone when the command ends."""
    import os

    saved = {k: os.environ.get(k) for k in (USER_DIR_ENV, "PYTHONSAFEPATH")}
    try:
        cwd = str(Path.cwd())
    except OSError:  # the working directory was removed: nothing to import from
        cwd = ""
    # `python -m astraflow` put the directory first: resolve modules as the processes started will
    head = sys.path.pop(0) if cwd and sys.path and sys.path[0] == cwd and not sys.flags.safe_path else None
    added = bool(cwd) and cwd not in sys.path
    if cwd:
        os.environ[USER_DIR_ENV] = cwd
    os.environ["PYTHONSAFEPATH"] = "1"
    added = added and add_user_dir() is None
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if added and cwd in sys.path:
            sys.path.remove(cwd)
        if head is not None:
            sys.path.insert(0, head)


@main.command()
@click.argument("config", type=UserPath(dir_okay=False))
@click.option("--run-dir", type=UserPath(file_okay=False), help="Run directory (default: runs/<name>-<time>).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config value, e.g. --set run.max_steps=20 (repeatable; VALUE is YAML, list "
                   "elements are named: --set policies.solver.trainer.lr=1e-4).")
@click.option("--quiet", is_flag=True, help="No progress output.")
def run(config: str, run_dir: str | None, overrides: tuple[str, ...], quiet: bool) -> None:
    """Train with CONFIG (a YAML file) until every trainer has taken run.max_steps steps.

    Prints the Dask dashboard address, progress while it trains, and writes config.yaml,
    metrics.jsonl, summary.json, the trajectory store, the weight store and logs into the run
    directory. Ctrl-C (or SIGTERM, scancel, or the terminal closing: SIGHUP, unless started under
    nohup) stops cleanly without losing what was written and exits with 130; SIGUSR1 (the head
    job's walltime warning) stops the same way and exits with 75 (the head job then requeues), as
    does a run whose Dask scheduler process died (it resumes); a failed run exits with 1 and its
    reason in one line.
    summary.json records how the run ended and the worker jobs are cancelled. Run again on the
    directory to resume it (jobs a previous incarnation left are cancelled first).
    """
    click.get_current_context().with_resource(owner_only())  # inherited by the processes it starts
    cfg = load_checked_config(config, overrides)
    try:
        rd = Path(run_dir) if run_dir else _default_run_dir(cfg.run.name)
    except ValueError as err:  # another user could change where it would go
        raise UserError(str(err)) from None
    except OSError as err:  # runs/ here cannot be made or written (a read-only working directory)
        where = Path(err.filename or "runs").absolute().parent
        raise UserError(f"the run directory cannot be made in {where} ({err.strerror or err}): pass --run-dir "
                        "in a place you can write to") from None
    if run_dir:
        _not_someone_elses_files(rd)
    try:
        _not_another_runs_store(cfg.storage.trajectories, rd)
        _run(cfg, rd, quiet)
    finally:
        if not run_dir:  # the directory claimed for it, left empty (bad data): nothing behind
            try:
                rd.rmdir()
            except OSError:
                pass


#: what a run writes at the top of its directory (``storage.paths.RunPaths``)
RUN_DIR_ENTRIES = frozenset({"config.yaml", "metrics.jsonl", "summary.json", "scheduler.json", "control", "logs",
                             "jobs", "weights", "trajectories", "trainer_state", "security", "plots", "tensorboard"})


def _not_someone_elses_files(rd: Path) -> None:
    """A ``--run-dir`` that is no run's (no ``control/``, which every run makes first) but holds
    files a run would write over (a project folder with its own config.yaml, say) is refused.
    Other files there (a job's output, ``.gitkeep``, ``lost+found``) are left alone."""
    try:
        found = sorted(p.name for p in rd.iterdir() if p.name in RUN_DIR_ENTRIES) \
            if rd.is_dir() and not (rd / "control").is_dir() else []
    except OSError:
        return  # unreadable: the run directory's own checks say so
    if found:
        raise UserError(f"--run-dir {rd} is no run's directory (no control/) but holds {', '.join(found)}, which a "
                        "run would write over. Pass a new or empty directory, or the directory of a run to "
                        "resume it")


def _not_another_runs_store(url: str | None, rd: Path) -> None:
    """A ``storage.trajectories`` that is another run directory's own store is refused: that run
    owns it (keeping no trajectories, its resume deletes every segment it does not need)."""
    from storage.trajectories.locations import owning_run

    owner = owning_run(url) if url else None
    if owner is not None and owner.resolve() != rd.resolve():
        raise UserError(f"storage.trajectories {url} is the trajectory store of the run in {owner}, which owns "
                        "it (it may delete segments it does not need): give a directory outside any run "
                        "directory to share a store, or leave storage.trajectories out (<run>/trajectories)")


def _run(cfg, rd: Path, quiet: bool) -> None:
    """``run`` in ``rd``: its exits and messages (``run``'s docstring)."""
    from astraflow.runtime.launch import launch
    from astraflow.runtime.stopping import ignore_stop_signals
    from astraflow.runtime.stopping import REQUEUE_EXIT_CODE, StopForRequeue, disk_full, disk_full_reason
    from astraflow.runtime.placement import SchedulerLost
    from astraflow.runtime.workers import RunFailed
    from astraflow.training.numerics import NonFiniteError

    try:
        result = launch(cfg, rd, quiet=quiet)
    except StopForRequeue as sig:  # before the run started: nothing to stop, resumed all the same
        click.echo(f"stopped by {sig.args[0]} for a requeue before the run started; run again on {rd}", err=True)
        sys.exit(REQUEUE_EXIT_CODE)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM before the run started (checking data, building models)
        ignore_stop_signals()
        with contextlib.suppress(OSError):  # its terminal closed (a hang-up)
            click.echo(f"stopped before the run started; run again on {rd} to start it", err=True)
        sys.exit(130)
    except ValueError as err:
        raise UserError(str(err)) from None
    except SchedulerLost as err:  # resumable: 75, on which the head job requeues itself (as for its walltime)
        ignore_stop_signals()
        with contextlib.suppress(OSError):
            click.echo(f"Error: the run failed: {err}", err=True)
        sys.exit(REQUEUE_EXIT_CODE)
    except (RunFailed, NonFiniteError) as err:  # the run started and failed: exit 1, its reason
        ignore_stop_signals()  # a late stop signal must not turn its 1 into death by signal either
        raise click.ClickException(f"the run failed: {err}") from None
    except OSError as err:  # a full disk before the run got going (lock, config, models)
        if not disk_full(err):
            raise
        raise click.ClickException(f"the run failed: {disk_full_reason(err, rd)}") from None
    if result is not None:  # a completed run's exit (0) outlives a stop signal in the interpreter's exit too
        ignore_stop_signals()
    if result is not None and result.interrupted:
        with contextlib.suppress(OSError):  # stopped because its terminal closed: nowhere to say it
            click.echo(f"the run was {result.ending.reason}; summary in {RunPaths(result.run_dir).summary}; "
                       "run again on this directory to resume it", err=True)
        sys.exit(REQUEUE_EXIT_CODE if result.ending.requeue else 130)


@main.group()
def model() -> None:
    """Build models locally (no downloads)."""


@model.command("init")
@click.argument("out", type=UserPath(file_okay=False, utf8=True))
@click.option("--preset", **field_option(ModelInit, "preset"))
@click.option("--arch", **field_option(ModelInit, "arch"))
@click.option("--seed", type=int, **field_option(ModelInit, "seed"))
@click.option("--tie-embeddings/--untie-embeddings", **field_option(ModelInit, "tie_embeddings"))
@click.option("--warm-start-seconds", type=float, **field_option(ModelInit, "warm_start_seconds"))
@click.option("--warm-start-steps", type=int, **field_option(
    ModelInit, "warm_start_steps",
    help="Upper bound of the warm start in optimiser steps (1 or more). Unset: no bound in steps (the warm start "
         "then runs for --warm-start-seconds, and not at all when that is 0). Given alone, the warm start runs this "
         "many steps with no time bound; the warm start is seeded, so a bound in steps builds the same model on a "
         "fast and a slow machine of one kind (CPUs of other kinds round differently). With several bounds the "
         "first reached stops it."))
@click.option("--warm-start-lr", type=float, **field_option(ModelInit, "warm_start_lr"))
def model_init(out: str, preset: str, arch: str, seed: int, tie_embeddings: bool, warm_start_seconds: float,
               warm_start_steps: int | None, warm_start_lr: float) -> None:
    """Build a small Qwen2/Llama model (--preset) with a local byte-level tokenizer into OUT (HF format).

    The warm start trains on the math workload's train split (its default params, seed 0): a run
    with another workload.seed evaluates it partly on problems it was taught."""
    from pydantic import ValidationError

    from astraflow.configerrors import option_errors
    from storage.ownership import unbuildable
    from astraflow.runtime.model_build import ModelDirError, build_model, building
    from astraflow.runtime.progress import Progress

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
        with building(Path(out), Progress()):
            build_model(Path(out), init)
    except ModelDirError as err:
        raise UserError(f"OUT {err}") from None


@main.command()
@click.argument("run_dir", type=UserPath(file_okay=False))
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
    from astraflow.runtime.monitoring.snapshot import damaged_run_files
    from astraflow.runtime.monitoring.text import format_summary

    try:
        st = run_status(Path(run_dir))
    except RunNotRunning as err:  # a finished run has its final state to show; any other is an error
        try:
            snap = read_snapshot(Path(run_dir)) if Path(run_dir).is_dir() else None
        except ValueError as damaged:  # a damaged summary.json (named, with the fix)
            raise UserError(str(damaged)) from None
        if snap is not None and snap.summary is None and snap.stale and not snap.new_incarnation():
            # stopped without a summary (its orchestrator killed): its last state, said to be that
            try:
                click.echo(format_status({**snap.status, "running": False, "orchestrator": snap.info}))
            except (TypeError, AttributeError, KeyError, ValueError) as bad:
                raise UserError(str(damaged_run_files(run_dir, bad))) from None
            age = f"of {snap.age_s:.0f}s ago" if snap.age_s is not None else "undated (it has no written_at)"
            raise UserError(_silent_run(Path(run_dir), snap.age_s)
                            or f"{err}: above is its last status, {age}; `astraflow run` on "
                               f"the run directory resumes it{_resumes_from(Path(run_dir))}") from None
        if snap is None or snap.summary is None or snap.new_incarnation():
            # a resume holding the directory has not set the previous incarnation's summary aside yet
            raise UserError(str(err)) from None
        try:
            # the summary's table is counted from the final state; the last status predates the end
            parts = snap.summary.get("partitions") or (snap.status or {}).get("partitions") or {}
            click.echo(format_summary(snap.summary, str(snap.paths.summary), parts))
        except (TypeError, AttributeError, KeyError, ValueError) as bad:  # a field of a type no writer writes
            raise UserError(str(damaged_run_files(run_dir, bad))) from None
        return
    except ValueError as err:  # a damaged status file (named, with the fix)
        raise UserError(str(err)) from None
    try:
        click.echo(format_status(st))
    except (TypeError, AttributeError, KeyError, ValueError) as bad:
        raise UserError(str(damaged_run_files(run_dir, bad))) from None


def _resumes_from(run_dir: Path) -> str:
    """`` from solver v30 (...)``: each policy's newest committed version, where a resume goes on
    (a killed run's last status may be some steps older); empty without one."""
    from storage.weights import WeightStore

    store = WeightStore(RunPaths(run_dir).weights)
    at = [(p, vs[-1]) for p in store.policies() if (vs := store.versions(p))]
    return f" from {', '.join(f'{p} v{v}' for p, v in at)} (the newest committed weights)" if at else ""


def _silent_run(run_dir: Path, age_s: float | None) -> str | None:
    """What to say of a run whose status went stale while its `astraflow run` still lives and holds
    the directory (suspended, or busy or hung: its workers may well go on training), where a
    resume would be refused; None when no live run holds it."""
    from astraflow.stop_cli import live_holder, process_state

    try:
        pid = int(live_holder(run_dir)["pid"])
    except UserError:
        return None
    said = (f"the run in {run_dir} has written no status for {age_s:.0f}s (above is its last)" if age_s is not None
            else f"the run in {run_dir} has written no dated status (above is its last)")
    if process_state(pid) in ("T", "t"):
        return (f"{said}: its `astraflow run` (pid {pid}) is suspended (Ctrl-Z or SIGSTOP) and still holds the "
                f"run directory; `fg` in its terminal or `kill -CONT {pid}` lets it go on")
    return (f"{said}: its `astraflow run` (pid {pid}) still holds the run directory but is busy or hung; "
            f"`astraflow stop {shell_arg(run_dir)}` stops it, then `astraflow run` on the directory resumes it")


@main.command()
@click.argument("run_dir", type=UserPath(file_okay=False, exists=True))
@click.option("--out", type=UserPath(file_okay=False), help="Output directory (default: RUN_DIR/plots).")
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
@click.argument("run_dir", type=UserPath(file_okay=False, exists=True))
@click.option("--logdir", type=UserPath(file_okay=False), help="Event file directory (default: RUN_DIR/tensorboard).")
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


main.add_command(partitions_cli)  # astraflow partitions list/add/remove RUN_DIR: see docs/autoscaling.md
main.add_command(sandbox_cli)  # astraflow sandbox run PROGRAM [--tests FILE]: see docs/sandbox.md
main.add_command(plan_cli)  # astraflow plan CONFIG --pool KIND=GPUS: see docs/sim.md
main.add_command(stop_cli)  # astraflow stop RUN_DIR: Ctrl-C from another shell
main.add_command(episodes_cli)  # astraflow episodes RUN_DIR: what the policies wrote
main.add_command(check_cli)  # astraflow check CONFIG: what run checks, nothing started
main.add_command(export_cli)  # astraflow export RUN_DIR OUT: a version as an HF model

if __name__ == "__main__":
    main()
