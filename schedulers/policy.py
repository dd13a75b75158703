"""What a partition may ask of the processes it starts: the environment variables of its workers
and the extra sbatch options of their jobs.

A partition's `env` and `sbatch_options` come from the run's config (its owner's) and from
``control/partitions.json`` (written by ``astraflow partitions add``, on a filesystem other
users may share). A variable such as ``LD_PRELOAD`` or ``PYTHONPATH``, or an option such as
``--export`` or ``--chdir``, lets whoever sets it run code as the run's owner, so both go
through allowlists the config holds (``cluster.worker_env_allowlist``,
``cluster.sbatch_options_allowlist``). `WorkerPolicy.check` applies them; it is called wherever a
partition enters a run: the config load, ``astraflow partitions add`` and the orchestrator
reading ``control/partitions.json``.

Env allowlist entries are names or ``fnmatch`` patterns (case-sensitive). A variable that loads
code, chooses the interpreter or shell, or redirects where trust and credentials go
(`UNSAFE_ENV`) is admitted only by an entry that names it exactly: a site that needs
``LD_LIBRARY_PATH`` lists it, and a pattern (even ``*``) never admits it by accident.
Sbatch allowlist entries are exact option names (``--qos``): sbatch accepts unambiguous
abbreviations (``--exp`` for ``--export``), which an exact match refuses.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Annotated

from pydantic import AfterValidator

from schedulers.partition import MANAGED_SBATCH_OPTIONS, Partition

ENV_FIELD = "cluster.worker_env_allowlist"
SBATCH_FIELD = "cluster.sbatch_options_allowlist"

#: tuning knobs of the libraries workers run (threads, GPUs, collectives, logging); none of
#: them loads code or sends data somewhere else
DEFAULT_WORKER_ENV_ALLOWLIST: tuple[str, ...] = (
    # threads
    "OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS", "TOKENIZERS_PARALLELISM",
    # GPUs and PyTorch
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_LAUNCH_BLOCKING", "CUDA_MODULE_LOADING",
    "CUBLAS_WORKSPACE_CONFIG", "PYTORCH_CUDA_ALLOC_CONF", "TORCH_NCCL_*", "TORCH_DISTRIBUTED_DEBUG",
    "TORCH_SHOW_CPP_STACKTRACES", "TORCH_LOGS", "TORCH_CPP_LOG_LEVEL",
    # collectives and interconnects
    "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_SOCKET_IFNAME", "NCCL_IB_*", "NCCL_P2P_*", "NCCL_SHM_DISABLE",
    "NCCL_NET_GDR_LEVEL", "NCCL_ALGO", "NCCL_PROTO", "NCCL_CROSS_NIC", "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS", "NCCL_BUFFSIZE", "NCCL_NVLS_ENABLE", "GLOO_SOCKET_IFNAME", "UCX_TLS",
    "UCX_NET_DEVICES", "FI_PROVIDER",
    # Hugging Face and logging, without endpoints or cache directories
    "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY",
    "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY", "WANDB_MODE", "WANDB_PROJECT",
    "WANDB_ENTITY", "WANDB_RUN_GROUP", "WANDB_SILENT",
    # the Dask monitor settings AstraFlow quiets (schedulers.command.QUIET_DASK_ENV)
    "DASK_DISTRIBUTED__WORKER__PROFILE__*", "DASK_DISTRIBUTED__ADMIN__TICK__*",
    "DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__*", "DASK_DISTRIBUTED__WORKER__MEMORY__*", "DASK_LOGGING__ASTRAFLOW",
    # scratch space and locale
    "TMPDIR", "LANG", "LC_*", "TZ",
)

#: variables that load code (loader, interpreter, plugin, injection and config-file variables),
#: choose the shell's behaviour, or redirect trust, credentials or traffic: admitted only by an
#: allowlist entry that names them exactly
UNSAFE_ENV: tuple[str, ...] = (
    "LD_*", "DYLD_*", "PYTHON*", "*PATH", "PATH*", "BASH_ENV", "ENV", "BASH_FUNC_*", "SHELLOPTS",
    "BASHOPTS", "IFS", "PS4", "PROMPT_COMMAND", "GLOBIGNORE", "SHELL", "HOME", "XDG_*", "PERL5*", "PERLLIB",
    "RUBY*", "NODE_OPTIONS", "JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS", "MALLOC_*", "GLIBC_TUNABLES", "LOCPATH",
    "HOSTALIASES", "RES_OPTIONS", "LOCALDOMAIN", "*PRELOAD*", "*PLUGIN*", "*INJECTION*", "*_CONF_FILE",
    "*CONFIG_FILE*", "DASK_*CONFIG*", "DASK_DISTRIBUTED__COMM__*", "DASK_DISTRIBUTED__WORKER__PRELOAD*",
    "DASK_LOGGING*", "DASK_DISTRIBUTED__LOGGING*",
    "*CA_BUNDLE*", "SSL_*", "*_CERT*", "*PROXY*", "*proxy*", "*ENDPOINT*", "*_URL", "*_HOST", "SLURM_*",
    "*_CACHE", "*CACHE_DIR*", "*_HOME", "*_MODULE_DIR", "*EXTENSIONS_DIR*",
)

#: options that are harmless to the account and to how AstraFlow tracks its jobs
DEFAULT_SBATCH_OPTIONS_ALLOWLIST: tuple[str, ...] = (
    "--account", "--qos", "--constraint", "--prefer", "--reservation", "--exclusive", "--oversubscribe",
    "--exclude", "--nodelist", "--mail-type", "--mail-user", "--signal", "--requeue", "--no-requeue",
    "--hint", "--threads-per-core", "--mem-per-cpu", "--mem-per-gpu", "--gpus-per-task", "--gres-flags",
    "--cpu-freq", "--licenses", "--wckey", "--tmp", "--switches", "--begin", "--deadline", "--time-min",
    "--nice",
)

#: options that break how AstraFlow submits and tracks a worker's job: refused even when listed
NEVER_SBATCH_OPTIONS: dict[str, str] = {
    "--array": "one worker is one job, named after the worker",
    "--wrap": "the job runs the rendered worker script",
    "--wait": "sbatch must return the job id at once",
    "--test-only": "the job must be submitted",
    "--clusters": "the run finds its jobs with squeue on this cluster",
    "--uid": "jobs run as the user who starts the run",
    "--gid": "jobs run as the user who starts the run",
}

_ENV_ENTRY = re.compile(r"^[A-Za-z0-9_*?\[\]!]+$")
_SBATCH_ENTRY = re.compile(r"^--[a-z][a-z0-9-]*$")


class PolicyError(ValueError):
    """A partition asks for a variable or an sbatch option the run's allowlists refuse."""


def check_env_allowlist(entries: Iterable[str]) -> tuple[str, ...]:
    """The entries of ``cluster.worker_env_allowlist`` if each is a name or pattern, else ValueError."""
    out = tuple(entries)
    bad = [e for e in out if not _ENV_ENTRY.match(e)]
    if bad:
        raise ValueError(f"{ENV_FIELD}: {bad} are not variable names or fnmatch patterns: use letters, "
                         "digits, '_' and the wildcards '*', '?', '[...]'")
    return out


def check_sbatch_allowlist(entries: Iterable[str]) -> tuple[str, ...]:
    """The entries of ``cluster.sbatch_options_allowlist`` if each is an option AstraFlow lets
    partitions set, else ValueError naming it and why."""
    out = tuple(entries)
    for e in out:
        if not _SBATCH_ENTRY.match(e):
            raise ValueError(f"{SBATCH_FIELD}: {e!r} is not an sbatch option name: write it as '--option' "
                             "(the long form, without a value)")
        if e in MANAGED_SBATCH_OPTIONS:
            raise ValueError(f"{SBATCH_FIELD}: {e} is rendered from the partition ({MANAGED_SBATCH_OPTIONS[e]}): "
                             "remove it from the list")
        if e in NEVER_SBATCH_OPTIONS:
            raise ValueError(f"{SBATCH_FIELD}: {e} cannot be allowed ({NEVER_SBATCH_OPTIONS[e]}): "
                             "remove it from the list")
    return out


#: config field types of the two allowlists, each entry checked
EnvAllowlist = Annotated[list[str], AfterValidator(lambda v: list(check_env_allowlist(v)))]
SbatchAllowlist = Annotated[list[str], AfterValidator(lambda v: list(check_sbatch_allowlist(v)))]


def env_allowed(name: str, allowlist: Iterable[str]) -> bool:
    """Whether variable `name` is admitted: an entry names it exactly, or a pattern matches it
    and it is not one of `UNSAFE_ENV`."""
    allowlist = tuple(allowlist)
    if name in allowlist:
        return True
    if unsafe_env(name):
        return False
    return any(fnmatchcase(name, p) for p in allowlist)


def unsafe_env(name: str) -> bool:
    """Whether `name` is one of `UNSAFE_ENV`. Dask lower-cases what follows ``DASK_``, so
    ``DASK_distributed__worker__preload`` is the preload too: those are matched upper-cased."""
    names = {name, name.upper()} if name.startswith("DASK_") else {name}
    return any(fnmatchcase(n, p) for n in names for p in UNSAFE_ENV)


@dataclass(frozen=True)
class WorkerPolicy:
    """The run's allowlists for partition `env` names and `sbatch_options` names."""

    env_allowlist: tuple[str, ...] = DEFAULT_WORKER_ENV_ALLOWLIST
    sbatch_options_allowlist: tuple[str, ...] = DEFAULT_SBATCH_OPTIONS_ALLOWLIST

    @classmethod
    def of(cls, env: Iterable[str] | None = None, sbatch_options: Iterable[str] | None = None) -> "WorkerPolicy":
        """A policy from config values (None: the default list); ValueError for a bad entry."""
        return cls(
            check_env_allowlist(DEFAULT_WORKER_ENV_ALLOWLIST if env is None else env),
            check_sbatch_allowlist(DEFAULT_SBATCH_OPTIONS_ALLOWLIST if sbatch_options is None else sbatch_options),
        )

    def problems(self, part: Partition) -> list[str]:
        """Why `part` is refused, one line per variable or option (empty: accepted)."""
        out = []
        for name in sorted(part.env):
            if not env_allowed(name, self.env_allowlist):
                why = (" (it can load code or redirect trust, so only an entry naming it exactly admits it)"
                       if unsafe_env(name) else "")
                out.append(f"partitions[{part.name}].env: {name} is not in {ENV_FIELD}{why}: remove it from the "
                           f"partition, or add {name!r} to {ENV_FIELD} in the run's config")
        for opt in part.sbatch_options:
            key = opt.split("=", 1)[0]
            if key in NEVER_SBATCH_OPTIONS:
                out.append(f"partitions[{part.name}].sbatch_options: {key} cannot be used "
                           f"({NEVER_SBATCH_OPTIONS[key]}): remove it")
            elif key not in self.sbatch_options_allowlist:
                out.append(f"partitions[{part.name}].sbatch_options: {key} is not in {SBATCH_FIELD}: remove it "
                           f"from the partition, or add {key!r} to {SBATCH_FIELD} in the run's config")
        return out

    def check(self, part: Partition) -> None:
        """Raise `PolicyError` listing every refused variable and option of `part`."""
        problems = self.problems(part)
        if problems:
            raise PolicyError("; ".join(problems))

    def refusals(self, parts: Mapping[str, Partition]) -> dict[str, str]:
        """The refused partitions of `parts` by name, with why."""
        return {name: "; ".join(p) for name, part in parts.items() if (p := self.problems(part))}
