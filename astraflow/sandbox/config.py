"""The run config's top-level ``sandbox:`` section: how many executions run at once and the
limits each one gets. A leaf: pydantic and the config base only."""

from __future__ import annotations

from pydantic import Field

from astraflow.configbase import Strict


class SandboxConfig(Strict):
    concurrency: int = Field(2, ge=1)
    """Executions at once per process (per RaaS node); more callers wait for a slot."""
    timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    """Wall-clock limit of one execution; past it the whole process tree is killed (status
    ``timeout``)."""
    cpu_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    """CPU-time limit of each process of an execution (RLIMIT_CPU; status ``timeout``)."""
    memory_mb: int = Field(512, ge=32)
    """Address-space limit of each process (RLIMIT_AS): an allocation past it fails (status
    ``memory``)."""
    max_processes: int = Field(32, ge=2)
    """Processes (and threads) an execution may have at once (RLIMIT_NPROC in the execution's
    own user namespace, the interpreter included; isolated tests' judge comes on top)."""
    max_output_bytes: int = Field(65536, ge=1024)
    """Cap on stdout + stderr together; more kills the execution (status ``output_limit``)."""
    scratch_mb: int = Field(64, ge=1)
    """Size of the execution's writable scratch directory (a tmpfs, gone with the execution); also
    the most one file may hold (RLIMIT_FSIZE, at most ``memory_mb``)."""
    interpreter: str | None = None
    """Python run inside the sandbox; None = the base python3 of this machine (``/usr/bin/python3``,
    else the interpreter under this process's venv). Its prefix is bound read-only."""
    scratch_root: str | None = None
    """Host directory that holds each execution's inputs while it runs (removed afterwards);
    None = ``<system temp dir>/astraflow-sandbox-<uid>``. It must be yours, not a symbolic link,
    and not writable by group or others (else SandboxUnavailable). Keep it outside run directories."""
    sandbox_uid: int = Field(65534, ge=1)
    """When the node runs as root: the unprivileged uid (and gid) an execution runs as, so
    the kernel enforces the process limit (it exempts root). Default: nobody."""
    bwrap: str = "bwrap"
    """The bubblewrap executable (a name on PATH or a path)."""
    isolate_tests: bool = True
    """Run the tests in a process of their own, against proxies of what the program defined:
    only plain values (numbers, strings, bytes, None and containers of them) cross, the program
    never sees the tests' source, and it cannot patch the tests' builtins or make a value equal
    to everything (``docs/sandbox.md``). False: the tests run in the program's interpreter and
    namespace (they may then use any object of the program, and the program can cheat them)."""


#: what an execution may take past its wall-clock limit: starting bubblewrap, killing it, its pipes closing
OVERHEAD_S = 2.0


def deadline_problem(sandbox: SandboxConfig, program_timeout_s: float | None, reward_timeout_s: float) -> str | None:
    """Why a reward deadline of ``reward_timeout_s`` would fail the episodes of programs that
    merely run to their limit (``program_timeout_s``, else the sandbox's) instead of scoring
    them as timeouts; None when it leaves room."""
    limit = sandbox.timeout_s if program_timeout_s is None else program_timeout_s
    if reward_timeout_s >= limit + OVERHEAD_S:
        return None
    return (f"rollout.reward_timeout_s {reward_timeout_s:g} leaves no room for a program that runs to its "
            f"{limit:g} s sandbox limit (it would fail its episode instead of scoring a timeout): set "
            f"rollout.reward_timeout_s to at least {limit + OVERHEAD_S:g}, or lower the program timeout")
