"""``astraflow export RUN_DIR OUT``: a run's committed weight version written as an HF model
directory (``model_export``), or ``--list`` the versions there are. Safe while the run goes on."""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Iterator

import click

from astraflow.clibase import UserError, UserPath


@click.command("export")
@click.argument("run_dir", type=UserPath(file_okay=False, exists=True))
@click.argument("out", type=UserPath(file_okay=False, utf8=True), required=False)
@click.option("--policy", help="The policy to export (needed when the run trains several).")
@click.option("--version", type=click.IntRange(min=0), help="The weight version (default: the newest committed).")
@click.option("--dtype", type=click.Choice(["auto", "fp32", "bf16", "fp16"]), default="auto", show_default=True,
              help="Dtype of the written weights; auto keeps the one the trainer published in.")
@click.option("--tokenizer", type=UserPath(file_okay=False, exists=True),
              help="Directory with the tokenizer files (default: the policy's model directory).")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Largest safetensors file: bytes, or a number with KB, MB, GB or TB.")
@click.option("--force", is_flag=True, help="Replace an earlier export in OUT.")
@click.option("--list", "list_only", is_flag=True, help="List each policy's committed versions and exit.")
def export(run_dir: str, out: str | None, policy: str | None, version: int | None, dtype: str,
           tokenizer: str | None, max_shard_size: str, force: bool, list_only: bool) -> None:
    """Write a trained policy of the run in RUN_DIR as an HF model directory OUT (config.json,
    safetensors, tokenizer), checked by loading it back. Load OUT with transformers or vLLM, or
    start a run from it (policies[].model: OUT). Works while the run goes on."""
    from astraflow.model_export import ExportError, committed_versions, export_version, parse_size

    try:
        if list_only:
            if out is not None:  # a listing writes nothing: OUT would be ignored without a word
                raise UserError(f"--list writes nothing, so OUT ({out}) would be ignored: drop OUT to list the "
                                "versions, or drop --list to export")
            listed = committed_versions(run_dir)
            for name, rows in listed.items():
                for r in rows:
                    if "damaged" in r:
                        click.echo(f"{name} v{r['version']}: damaged ({r['damaged']})")
                        continue
                    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["committed_at"]))
                    step = f"train step {r['train_steps']}, " if r["train_steps"] is not None else ""
                    click.echo(f"{name} v{r['version']}: {step}{r['dtype']}, {r['layout']} layout, committed {when}")
            if not any(listed.values()):
                click.echo(f"{run_dir} has no committed weight version yet")
            return
        if out is None:
            raise UserError("name the output directory: astraflow export RUN_DIR OUT (or --list the versions)")
        with _stops_as_ctrl_c():  # SIGTERM/SIGHUP (a job's time limit, a closed terminal) clean up as Ctrl-C
            export_version(run_dir, out, policy=policy, version=version, dtype=dtype, tokenizer=tokenizer,
                           force=force, max_shard_size=parse_size(max_shard_size), say=click.echo)
    except ExportError as err:
        raise UserError(str(err)) from None
    except KeyboardInterrupt:
        click.echo("export stopped; nothing was written to OUT", err=True)
        sys.exit(130)


@contextlib.contextmanager
def _stops_as_ctrl_c() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt in the block, so its cleanup runs as on Ctrl-C."""
    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    before = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
