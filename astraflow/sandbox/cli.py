"""``astraflow sandbox``: run a program (and its tests) in the sandbox from the command line.

Registered on the main CLI by ``astraflow.cli``; kept here so the sandbox stays one package.
Bad input (a missing file, a bad timeout, bubblewrap missing) exits 2 with one line naming the
fix (an option of this command where the run config's field has one: ``--bwrap``,
``--interpreter``, ``--scratch-root``); a program that ran exits 0 whatever it returned; a sandbox that failed exits 1.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import click

from astraflow.clibase import UserPath, printable


class BadInput(click.ClickException):
    """Bad input: exit code 2 and one message that names the fix (as the main CLI's UserError)."""

    exit_code = 2


@click.group()
def sandbox() -> None:
    """Run model-written Python in the bubblewrap sandbox (see docs/sandbox.md)."""


@sandbox.command("run")
@click.argument("program", type=UserPath(dir_okay=False, path_type=Path))
@click.option("--tests", "tests_file", type=UserPath(dir_okay=False, path_type=Path), default=None,
              help="Python file of tests of PROGRAM; each top-level test_* function is one test. They run in a "
                   "process of their own against what PROGRAM defined (only plain values cross).")
@click.option("--shared-tests", is_flag=True,
              help="Run --tests in PROGRAM's own interpreter and namespace (sandbox.isolate_tests: false): "
                   "any object crosses, and PROGRAM can cheat them.")
@click.option("--timeout", "timeout_s", type=float, default=None,
              help="Wall-clock limit in seconds (default: sandbox.timeout_s).")
@click.option("--bwrap", "bwrap", default=None, metavar="PATH",
              help="The bubblewrap executable (default: bwrap on PATH).")
@click.option("--interpreter", default=None, metavar="PATH",
              help="The Python run inside the sandbox (default: this machine's base python3).")
@click.option("--scratch-root", default=None, metavar="DIR",
              help="Where each execution's inputs are put while it runs (default: astraflow-sandbox-<uid> in "
                   "the temp directory, $TMPDIR). It must be yours and writable by no one else.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def run_cmd(program: Path, tests_file: Path | None, shared_tests: bool, timeout_s: float | None, bwrap: str | None,
            interpreter: str | None, scratch_root: str | None, as_json: bool) -> None:
    """Run PROGRAM (and --tests) in the sandbox and print the structured result."""
    from . import Sandbox, SandboxConfig, SandboxUnavailable

    source = _read_bytes(program, "PROGRAM")  # bytes: a program that is not UTF-8 fails inside
    tests = None
    if tests_file is not None:
        try:
            tests = _read_bytes(tests_file, "--tests").decode("utf-8")
        except UnicodeDecodeError as err:
            raise BadInput(f"--tests {tests_file} is not UTF-8 ({err}): save it as UTF-8") from None
    if timeout_s is not None and not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise BadInput(f"--timeout {timeout_s}: give a positive, finite number of seconds")
    given = (("bwrap", bwrap), ("interpreter", interpreter), ("scratch_root", scratch_root))
    cfg = SandboxConfig(**{k: v for k, v in given if v}, isolate_tests=not shared_tests)
    try:
        result = Sandbox(cfg).run(source, tests, timeout_s=timeout_s)
    except SandboxUnavailable as err:
        raise BadInput(cli_words(str(err))) from None
    if as_json:
        click.echo(json.dumps(result.to_json()))
    else:
        click.echo(summary(result))
    if result.status == "sandbox_error":
        raise SystemExit(1)


def cli_words(message: str) -> str:
    """A SandboxUnavailable message with the run config's fields this command takes as options
    named as those options (``sandbox.bwrap`` is ``--bwrap`` here)."""
    for field in ("bwrap", "interpreter", "scratch_root"):
        message = message.replace(f"sandbox.{field}", f"--{field.replace('_', '-')}")
    return message


def _read_bytes(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise BadInput(f"{what} {path}: {err.strerror or err}: give the path of a Python file") from None


def summary(result) -> str:
    """A readable account of a SandboxResult: the status, each test, the output (control
    characters shown as ``\\xNN``)."""
    tests = f"{result.passed}/{result.total} tests passed, " if result.tests else ""
    lines = [f"status: {result.status} ({tests}exit code {result.exit_code}, {result.wall_s:.2f} s)"]
    for t in result.tests:
        lines.append(f"  {'PASS' if t.passed else 'FAIL'} {t.name}" + (f": {printable(t.error)}" if t.error else ""))
    for name, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        if text:
            lines += [f"--- {name} ---", printable(text.rstrip("\n"))]
    return "\n".join(lines)
