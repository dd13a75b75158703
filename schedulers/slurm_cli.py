"""The Slurm command-line tools as `SlurmScheduler` (``slurm.py``) uses them: running one command
(`run_slurm`, its `SlurmCommandError`), the environment ``sbatch`` runs with, and reading what
``squeue --json`` says across Slurm versions (job states, exit codes, whose job it is)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pwd
import re
import shlex
import subprocess
import time
from collections.abc import Iterator, Sequence
from typing import Any

from schedulers.base import JobStatus
from schedulers.partition import Partition

# Slurm job states -> normalised JobState
_STATE_MAP = {
    "PENDING": "PENDING",
    "CONFIGURING": "PENDING",
    "REQUEUED": "PENDING",
    "REQUEUE_HOLD": "PENDING",
    "REQUEUE_FED": "PENDING",
    "RESV_DEL_HOLD": "PENDING",
    "RUNNING": "RUNNING",
    "SUSPENDED": "RUNNING",  # holds its node, resumes where it was
    "STOPPED": "RUNNING",
    "RESIZING": "RUNNING",
    "SIGNALING": "RUNNING",
    "STAGE_OUT": "RUNNING",
    "COMPLETING": "RUNNING",  # processes still being cleaned up; the worker may still be connected
    "COMPLETED": "COMPLETED",
    "FAILED": "FAILED",
    "BOOT_FAIL": "FAILED",
    "NODE_FAIL": "FAILED",
    "OUT_OF_MEMORY": "FAILED",
    "TIMEOUT": "FAILED",
    "DEADLINE": "FAILED",
    "SPECIAL_EXIT": "FAILED",
    "CANCELLED": "CANCELLED",
    "PREEMPTED": "CANCELLED",
    "REVOKED": "CANCELLED",
}


class SlurmCommandError(RuntimeError):
    """A Slurm command failed. `returncode` is the command's exit status (127: the command is
    not installed, 124: it timed out); `cmd`, `stdout`, `stderr` are what ran and what it said."""

    def __init__(self, cmd: Sequence[str], returncode: int, stdout: str, stderr: str):
        self.cmd = list(cmd)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(f"`{shlex.join(self.cmd)}` exited with {returncode}: {(stderr or stdout).strip()[-2000:]}")


class PartialSubmitError(SlurmCommandError):
    """``submit`` failed part way: the failed ``sbatch`` (its command, exit code and output)
    and ``cancelled``, the ids of the jobs the call had submitted before it, then cancelled."""

    def __init__(self, failed: SlurmCommandError, cancelled: list[str], undone: str):
        super().__init__(failed.cmd, failed.returncode, failed.stdout, failed.stderr)
        self.cancelled = list(cancelled)
        self.args = (f"sbatch failed after {len(cancelled)} job(s) of the request were submitted: {failed}; {undone}",)


class SlurmWaitTimeout(TimeoutError):
    """`wait_for` reached its deadline; `last` maps each job id to its last seen status (or None)."""

    def __init__(self, message: str, last: dict[str, JobStatus | None]):
        self.last = last
        super().__init__(message)


#: sbatch's input variables for what the worker script renders, or for options that would break
#: job tracking: sbatch ranks them above the script's ``#SBATCH`` lines, so a user's personal
#: default (``SBATCH_PARTITION``, ``SBATCH_TIMELIMIT``...) would silently replace the partition's
#: settings (a renamed job is not even found again). Others (account, QOS...) still apply.
SBATCH_ENV_IGNORED = frozenset({
    "SBATCH_JOB_NAME", "SBATCH_PARTITION", "SBATCH_TIMELIMIT", "SBATCH_GRES", "SBATCH_GPUS",
    "SBATCH_GPUS_PER_NODE", "SBATCH_GPUS_PER_TASK", "SBATCH_MEM_PER_NODE", "SBATCH_ARRAY_INX", "SBATCH_WAIT",
    "SBATCH_CLUSTERS", "SLURM_CLUSTERS", "SBATCH_EXPORT", "SBATCH_OUTPUT", "SBATCH_ERROR",
})
#: ignored as well when the partition sets ``mem`` (sbatch refuses them together)
SBATCH_MEM_ENV = frozenset({"SBATCH_MEM_PER_CPU", "SBATCH_MEM_PER_GPU"})


def sbatch_env(partition: Partition, environ: dict[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """The environment ``sbatch`` runs with for ``partition``'s workers, and the names of the
    variables left out of it (``SBATCH_ENV_IGNORED``)."""
    environ = dict(os.environ if environ is None else environ)
    drop = SBATCH_ENV_IGNORED | (SBATCH_MEM_ENV if partition.mem is not None else frozenset())
    left_out = sorted(k for k in environ if k in drop)
    return {k: v for k, v in environ.items() if k not in drop}, left_out


def user_name() -> str:
    """The name of this process's user, from its uid (``$USER`` may name someone else after
    ``su`` or in a container)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:  # a uid without a passwd entry (some containers)
        return str(os.getuid())


def is_mine(job: dict[str, Any], uid: int, name: str) -> bool:
    """Whether an ``squeue --json`` job belongs to this process's user: by uid when listed."""
    if job.get("user_id") is not None:
        try:
            return int(job["user_id"]) == uid
        except (TypeError, ValueError):
            pass
    return job.get("user_name", name) == name


def run_slurm(cmd: Sequence[str], *, timeout: float = 30.0, input: str | None = None,
              env: dict[str, str] | None = None) -> str:
    """Run one Slurm command and return its stdout; raise `SlurmCommandError` on failure.

    The single place where this package shells out to Slurm. ``env``: the command's environment
    (None: this process's).
    """
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, input=input, env=env)
    except FileNotFoundError as e:
        raise SlurmCommandError(cmd, 127, "", f"{cmd[0]}: command not found ({e}); is Slurm installed on "
                                "this host?") from e
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise SlurmCommandError(cmd, 124, out, err + f"\ntimed out after {timeout} s") from e
    if proc.returncode != 0:
        raise SlurmCommandError(cmd, proc.returncode, proc.stdout, proc.stderr)
    return proc.stdout


def backoff(deadline: float, initial: float = 0.1, factor: float = 1.6, maximum: float = 2.0) -> Iterator[float]:
    """Sleep intervals (seconds) growing from `initial` to `maximum`, until `deadline`
    (a `time.monotonic()` value): yields the interval after sleeping it."""
    delay = initial
    while (left := deadline - time.monotonic()) > 0:
        step = min(delay, left)
        time.sleep(step)
        yield step
        delay = min(delay * factor, maximum)


def normalise_state(raw: str) -> str:
    """Slurm job state (``RUNNING``, ``CANCELLED by 0``, ``TIMEOUT``...) -> a `JobState`."""
    base = raw.split()[0].upper() if raw else ""
    return _STATE_MAP.get(base, "UNKNOWN")


def state_text(value: Any) -> str:
    """``job_state`` of ``squeue --json`` as text: a string up to Slurm 23.02, a list of flags
    from 23.11 on (``["RUNNING"]``, ``["PENDING", "REQUEUED"]``: the base state first)."""
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value or "")


def exit_code(value: Any) -> int | None:
    """``exit_code`` of ``squeue --json``: a number up to 23.02, from 23.11 on an object whose
    ``return_code`` is ``{"set": ..., "number": n}`` (or a number)."""
    if isinstance(value, dict):
        value = value.get("return_code")
        if isinstance(value, dict):
            value = value.get("number") if value.get("set", True) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def slurm_version(timeout: float = 10.0) -> tuple[int, int]:
    """(major, minor) of the installed Slurm, from ``sinfo --version`` (e.g. ``slurm-wlm 22.05.8``)."""
    out = run_slurm(["sinfo", "--version"], timeout=timeout)
    m = re.search(r"(\d+)\.(\d+)", out)
    if not m:
        raise SlurmCommandError(["sinfo", "--version"], 0, out, "no version number in the output")
    return int(m.group(1)), int(m.group(2))


def pyslurm_status() -> tuple[bool, str]:
    """Whether an installed pyslurm matches this site's Slurm (same major.minor release), and why.

    Never imports pyslurm when it is absent; never raises for a missing pyslurm or Slurm.
    """
    if importlib.util.find_spec("pyslurm") is None:
        return False, "pyslurm is not installed"
    have = importlib.metadata.version("pyslurm")
    try:
        major, minor = slurm_version()
    except SlurmCommandError as e:
        return False, f"pyslurm {have} is installed but Slurm is not reachable: {e}"
    m = re.match(r"(\d+)\.(\d+)", have)
    if not m or (int(m.group(1)), int(m.group(2))) != (major, minor):
        return False, f"pyslurm {have} does not match Slurm {major}.{minor:02d}: the CLI backend is used"
    return True, f"pyslurm {have} matches Slurm {major}.{minor:02d}"


def first_then(it: Iterator[float]) -> Iterator[float]:
    """Yield once immediately, then follow `it` (poll first, sleep after)."""
    yield 0.0
    yield from it
