"""The run's own sections of the config, ``run``, ``cluster`` and ``autoscale``: how the run as a
whole is named, bounded, placed and scaled (the orchestrator reads them; no component does).
``astraflow.config`` composes them with the components' sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from astraflow.configbase import Strict
from schedulers.command import is_loopback
from schedulers.partition import Partition
from schedulers.policy import (DEFAULT_SBATCH_OPTIONS_ALLOWLIST, DEFAULT_WORKER_ENV_ALLOWLIST, EnvAllowlist,
                               SbatchAllowlist)
from schedulers.tls import TLSConfig
from storage.paths import NAME_MAX as RUN_NAME_MAX
from storage.paths import is_plain_name


#: ``cluster.placement_timeout_s`` when a rollout engine is ``vllm`` and the config sets none
VLLM_PLACEMENT_TIMEOUT_S = 600.0


class ClusterConfig(Strict):
    dashboard_port: int = Field(default=8787, ge=0, le=65535)
    """Dask dashboard port (0: any free port)."""
    dashboard_host: str = "127.0.0.1"
    """Address the dashboard binds to; the default keeps it on this machine (reach it through an
    SSH tunnel or the site's proxy). Any other address serves it over HTTPS with the run's
    certificate, to requests carrying the run's token only."""
    worker_start_timeout_s: float = Field(default=180.0, gt=0)
    """Deadline for requested workers to join the scheduler."""
    placement_timeout_s: float = Field(default=120.0, gt=0)
    """Deadline for an actor to be constructed and started on its worker (a RaaS node's start
    builds its engines). Where a rollout engine is ``vllm`` and this is not set, the default is
    ``VLLM_PLACEMENT_TIMEOUT_S``: vLLM's start loads, profiles and may compile the model."""
    drain_timeout_s: float = Field(default=120.0, gt=0)
    """Deadline for a removed RaaS node to finish and write its in-flight episodes before its
    job is cancelled anyway (what it still holds is requeued)."""
    stop_grace_s: float = Field(default=15.0, gt=0)
    """Longest the stop of a failed or interrupted run waits for its components (RaaS nodes
    flush, trainers stop, the data layer closes the ledger) before it cancels the worker jobs.
    Keep it well under Slurm's ``KillWait`` (30 s by default): after ``scancel`` the head job has
    that long before it is killed, and it still has to cancel its jobs and write the summary."""
    trainer_restarts: int = Field(default=2, ge=0)
    """Times the trainer of each policy is restarted when its worker is lost (killed, out of
    memory, node failure): a new worker is started and the trainer resumes from the newest
    committed version and optimiser checkpoint (``docs/failures.md``). Past it, or with 0, a
    lost trainer worker ends the run."""
    data_layer_restarts: int = Field(default=2, ge=0)
    """Times the data layer is re-placed when its worker is lost: a new worker is started and
    the data layer is rebuilt there from its durable state (``dataflow.durable``), with every
    lease, buffered sequence and served batch it had answered; trainers and RaaS nodes
    reconnect to it (``docs/failures.md``). Past it, or with 0, a lost data-layer worker ends
    the run."""
    scheduler_host: str = "127.0.0.1"
    """Address the Dask scheduler listens on. The loopback default keeps a one-host run on this
    machine; on a cluster use the head node's address or set `scheduler_interface`."""
    scheduler_interface: str | None = None
    """Network interface the Dask scheduler listens on (e.g. ``ib0``); overrides `scheduler_host`."""
    worker_interface: str | None = None
    """Interface workers listen on (e.g. ``ib0``), Slurm ones and those of ``scheduler: local``
    partitions on the head's host alike. None: Slurm workers the default route's, local ones the
    scheduler's address; ``127.0.0.1`` when the scheduler is on loopback (a one-host cluster)."""
    local_fork: bool = True
    """Start the workers of ``scheduler: local`` partitions as forks of one process that imported
    Dask, torch, transformers and AstraFlow's components once, instead of each importing them
    anew (seconds of CPU per worker). A partition whose ``env`` sets more than ``ASTRAFLOW_*``
    and ``DASK_*`` variables (or Dask's read at import, ``DASK_LOGGING__*`` say) gets fresh
    processes anyway; false: every worker does."""
    worker_python: str | None = None
    """Interpreter Slurm worker jobs run (a venv on the shared filesystem). None: the one
    running the orchestrator."""
    slurm_setup_lines: list[str] = Field(default_factory=list)
    """Shell lines every Slurm worker job runs before the worker (``module load ...``,
    ``source /shared/venv/bin/activate``)."""
    tls: TLSConfig = TLSConfig()
    """Mutual TLS on all Dask traffic: on by default with certificates the run creates
    (``docs/security.md``)."""
    worker_env_allowlist: EnvAllowlist = Field(default_factory=lambda: list(DEFAULT_WORKER_ENV_ALLOWLIST))
    """Environment variables a partition's ``env`` may set: names or fnmatch patterns. A list given
    here replaces the default (thread, GPU, NCCL and logging knobs; see ``schedulers/policy.py``).
    Loader, interpreter, shell, plugin and endpoint variables (``LD_*``, ``PYTHON*``, ``PATH``...)
    are admitted only by an entry naming them exactly."""
    sbatch_options_allowlist: SbatchAllowlist = Field(default_factory=lambda: list(DEFAULT_SBATCH_OPTIONS_ALLOWLIST))
    """Extra sbatch options a partition's ``sbatch_options`` may use: exact long names
    (``--account``, ``--qos``...). A list given here replaces the default; options AstraFlow
    renders itself or that break job tracking (``--array``, ``--wrap``...) cannot be listed."""

    @field_validator("scheduler_host", "scheduler_interface", "worker_interface", "dashboard_host")
    @classmethod
    def _one_word(cls, v: str | None, info) -> str | None:
        """An empty or spaced value would be dropped or misread on the command lines that take it
        (an empty interface even left the scheduler on every interface instead of loopback)."""
        if v is not None and (not v or any(c.isspace() for c in v) or v.startswith("-")):
            raise ValueError(f"{v!r} is not an address or interface name: give one word (e.g. 127.0.0.1, "
                             f"ib0), or leave {info.field_name} out for its default")
        return v

    @model_validator(mode="after")
    def _exposed_dashboard(self) -> "ClusterConfig":
        if not is_loopback(self.dashboard_host) and not self.tls.enabled:
            raise ValueError(
                f"cluster.dashboard_host {self.dashboard_host!r} is reachable from other machines, where the dashboard "
                "is served only over HTTPS with a token, which needs cluster.tls: enable it, or keep "
                "dashboard_host: 127.0.0.1 and open it through an SSH tunnel or your site's proxy")
        return self


class RunSection(Strict):
    name: str = "run"
    """Name of the run (run directories default to ``runs/<name>-<timestamp>``): 1-64 letters,
    digits, ``_ . -``, starting with a letter or digit."""
    max_steps: int = Field(default=50, ge=1)
    """Trainer steps per policy; the run ends when every trainer has taken them."""
    seed: int = Field(default=0, ge=0, lt=2**32)
    """Seed of the run: the prompt order, the dataflow rules, the trainers and the sampling (each
    episode samples from its own stream, seeded from this seed, its task and attempt); vary it,
    not ``workload.seed``, to repeat a run on the same problems. 0 to 2**32 - 1."""
    mode: Literal["async", "sync"] = "async"
    """``async``: the three components run their own loops (AstraFlow). ``sync``: a
    trainer-centred driver loop, the baseline for comparisons."""
    timeout_s: float = Field(default=3600.0, gt=0)
    """Deadline of the whole run, counted from its start; looked at once the components are up,
    so a run whose start-up outlasts it ends then."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        """The name becomes a path component and part of job names: nothing a shell, a path or
        a job name could read as more than one plain word."""
        if not is_plain_name(v) or len(v) > RUN_NAME_MAX:
            raise ValueError(f"{v!r} cannot name a run: use 1-{RUN_NAME_MAX} letters, digits, '_', '.', '-', "
                             "starting with a letter or digit (no spaces, '/', '%' or newlines), e.g. 'math-grpo'")
        return v


#: the default ``autoscale.memory_s``, in windows: long enough that a pool size seen too small is
#: not tried again soon (each try starves the trainers for a window), short enough that a load fall
#: the consumption counts do not show still lets the pool drain in the same run
MEMORY_WINDOWS = 60


class AutoscaleConfig(Strict):
    """The run's autoscaler (``astraflow.runtime.autoscale``): it grows or drains the rollout
    partitions that have ``autoscale:`` bounds, from how long the trainers wait for batches.
    docs/autoscaling.md explains the rule."""

    enabled: bool = True
    """``false``: the partitions' bounds are ignored (their ``nodes`` stay as set)."""
    high_wait: float = Field(default=0.3, gt=0, lt=1)
    """Add rollout workers when the trainers' wait fraction over ``window_s`` is above this
    (the busiest-waiting trainer counts: one starved trainer is enough)."""
    low_wait: float = Field(default=0.05, ge=0, lt=1)
    """Drain rollout workers when the wait fraction is below this (trainers always have data)."""
    max_stale_fraction: float | None = Field(default=None, gt=0, le=1)
    """Also drain when more than this fraction of the sequences that left the buffers over
    ``window_s`` were dropped as too stale (rollout runs ahead of training), unless the trainers
    wait above ``high_wait``. None: staleness is not a signal."""
    window_s: float = Field(default=30.0, gt=0, allow_inf_nan=False)
    """Seconds of evidence behind every decision: signals are averaged over this window, and the
    window starts afresh after each change once the workers it started or drained settled."""
    step_nodes: int = Field(default=1, ge=1)
    """Workers added or drained by one decision (less when a bound is closer)."""
    memory_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Seconds the autoscaler remembers a pool size at which the trainers waited above
    ``high_wait``: within them it does not drain back to that size unless their load visibly fell,
    so one worker that moves the wait across the whole band cannot make it flap.
    None: ``MEMORY_WINDOWS`` (60) times ``window_s``."""

    @field_validator("high_wait", "low_wait", "max_stale_fraction", mode="before")
    @classmethod
    def _fraction_not_percent(cls, value: object) -> object:
        """``high_wait: 30`` meant 30 %: say how to write it rather than only that it is too big."""
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 2 <= value <= 100:
            raise ValueError(f"{value} reads as a percentage; these are fractions of the time or of the "
                             f"sequences: write {value / 100:g} for {value:g} %")
        return value

    @property
    def memory_period_s(self) -> float:
        """``memory_s``, or its default from ``window_s``."""
        return self.memory_s if self.memory_s is not None else MEMORY_WINDOWS * self.window_s

    @model_validator(mode="after")
    def _band(self) -> "AutoscaleConfig":
        if self.low_wait >= self.high_wait:
            raise ValueError(f"autoscale: low_wait {self.low_wait} must be below high_wait {self.high_wait} (the band "
                             "between them is where nothing changes): e.g. low_wait: 0.05, high_wait: 0.3")
        return self


def check_autoscale(autoscale: AutoscaleConfig | None, partitions: list[Partition], mode: str) -> None:
    """The run's ``autoscale`` section against its partitions' bounds (ValueError naming the fix)."""
    bounded = [p.name for p in partitions if p.autoscale is not None]
    if autoscale is None:
        if bounded:
            raise ValueError(f"partitions {bounded} have autoscale bounds but the run has no autoscale section: "
                             "add one (e.g. autoscale: {high_wait: 0.3, low_wait: 0.05}) or remove the bounds")
        return
    if autoscale.enabled and not bounded:
        raise ValueError("autoscale: no partition has bounds to scale within: give a rollout partition "
                         "autoscale: {min_nodes: 1, max_nodes: 4}, or set autoscale.enabled: false")
    if autoscale.enabled and mode == "sync":
        raise ValueError("autoscale acts on asynchronous runs (run.mode: async); the sync baseline's driver "
                         "owns its phases: set autoscale.enabled: false or run.mode: async")
