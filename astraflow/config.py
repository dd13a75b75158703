"""Typed run configuration.

One YAML file describes a run; each component owns the section that configures it
(``dataflow``, ``rollout``, ``policies[].trainer``, ``partitions``) and receives only that
section, never the whole config. Cross-component rules are validators whose message says
how to fix the file. ``load_config`` applies ``--set key=value`` overrides before validation,
and the resolved config is written into the run directory.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from schedulers.partition import Partition


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


# -- models ------------------------------------------------------------------------------------


class ModelInit(_Strict):
    """How to build a model directory that does not exist yet (no downloads: built locally)."""

    preset: Literal["tiny", "mini", "small", "50m"] = "small"
    """Size preset of the locally initialised model (tiny ~0.8M, mini ~2.4M, small ~10M, 50m ~50M params)."""
    arch: Literal["qwen2", "llama"] = "qwen2"
    """HF architecture of the initialised model."""
    seed: int = 0
    """Seed of the random initialisation."""
    warm_start_seconds: float = Field(default=0.0, ge=0)
    """Supervised warm start on the workload's train split, in seconds (0: none). A partly
    competent policy gives RL a non-zero reward signal."""
    warm_start_steps: int | None = Field(default=None, ge=1)
    """Upper bound of the warm start in optimiser steps (``None``: none; set alone, it runs
    the warm start with no time bound). The warm start is seeded, so a bound in steps builds
    the same model on a fast and a slow machine, which a bound in seconds does not. With
    several bounds the first reached stops it."""
    warm_start_lr: float = Field(default=1e-3, gt=0)
    """Learning rate of the warm start."""
    warm_start_target: float | None = Field(default=None, gt=0, le=1)
    """Stop the warm start as soon as held-out accuracy reaches this (checked every 25 steps;
    ``warm_start_seconds`` / ``warm_start_steps`` stay the upper bounds). Makes RL start from
    the same competence on fast and slow machines. ``None``: run to the bounds."""
    task: Literal["solve", "solve_retry", "verify", "select"] = "solve"
    """Role the warm start teaches: ``solve`` (``"12+34="`` -> ``"46"``), ``solve_retry`` (the
    ``solver_verifier`` solver: half ``solve``, half its retry turn after a reject), ``verify`` (the
    ``solver_verifier`` verifier: ``"12+34=47?"`` -> ``"46N"``, its own sum, then the verdict) or
    ``select`` (the ``solver_selector`` selector: ``"12+34=46|47?"`` -> ``"46>1"``, its own sum,
    then the position of the candidate equal to it). Pick the one matching the policy's role in
    the workflow."""
    start_from: str | None = None
    """Name of an earlier policy in ``policies`` whose model this one starts from instead of a
    random initialisation (``preset``, ``arch`` and ``seed`` are then unused): the roles of one
    workflow sharing one base model, as multi-agent RL starts every agent from the same
    pretrained checkpoint. The warm start then teaches this policy's ``task`` on top."""

    @property
    def warm_starts(self) -> bool:
        """Whether the build includes a supervised warm start."""
        return self.warm_start_seconds > 0 or self.warm_start_steps is not None


# -- training ----------------------------------------------------------------------------------


class TrainerConfig(_Strict):
    """The trainer of one policy (owned by ``astraflow.training``)."""

    backend: Literal["torch", "megatron"] = "torch"
    """``torch``: plain PyTorch in the trainer worker; ``megatron``: Megatron-core ranks."""
    tensor_parallel: int = Field(default=1, ge=1)
    """Megatron tensor-parallel size (ranks started by the trainer actor); 1 for ``torch``."""
    lr: float = Field(default=5e-4, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    clip_low: float = Field(default=0.2, ge=0)
    """PPO clip range below 1 for the importance ratio."""
    clip_high: float = Field(default=0.28, ge=0)
    """PPO clip range above 1 (a higher upper clip keeps exploration alive)."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Gradient clipping norm."""
    micro_batch: int = Field(default=64, ge=1)
    """Sequences per forward/backward (gradient accumulation over the batch)."""
    threads: int = Field(default=1, ge=1)
    """torch intra-op threads of the trainer process."""
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """Where the torch backend trains: ``auto`` (the worker's GPU when it has one, else the
    CPU), ``cpu``, ``cuda`` or ``cuda:N``. The megatron backend places its ranks itself."""
    batch_timeout_s: float = Field(default=600.0, gt=0)
    """How long the trainer waits for one batch before it fails the run."""
    off_policy: Literal["ppo_clip", "tis", "m2po"] = "ppo_clip"
    """How the loss corrects for stale (off-policy) tokens, through the per-token ratio
    ``r = pi_new / pi_behaviour``: ``ppo_clip`` clips ``r`` to ``[1 - clip_low, 1 + clip_high]``
    (PPO surrogate); ``tis`` weights the policy gradient by ``min(r, is_cap)`` (truncated
    importance sampling); ``m2po`` masks the tokens with the largest ``(log r)^2`` until their
    batch mean is at most ``m2_tau`` and uses the unclipped ratio on the rest. The Megatron
    backend supports ``ppo_clip`` only."""
    is_cap: float = Field(default=2.0, gt=0)
    """``off_policy: tis``: the truncation ``C`` of the importance weight ``min(r, C)``."""
    m2_tau: float = Field(default=0.04, gt=0)
    """``off_policy: m2po``: bound on the mean ``(log r)^2`` of the tokens kept in the loss."""
    optimizer_checkpoint_every: int = Field(default=100, ge=0)
    """Torch backend: save the optimiser state (AdamW moments) every this many steps and when
    the trainer stops, under ``<run>/trainer_state/<policy>/``; a run resumed on the same run
    directory continues with it instead of fresh moments. 0: only when the trainer stops."""
    skip_zero_advantage: bool = True
    """Do not compute the forward/backward of sequences whose group-normalised advantage is 0
    (every sample of their group scored alike). They add exactly nothing to the
    ``ppo_clip``/``tis`` loss or its gradient, so the step is the same with less work (about
    40 % of the sequences of the main example). Both backends; ``m2po`` always trains every
    sequence."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """Torch backend: ``bf16`` runs the forward and backward under bf16 autocast (matrix
    products in bf16; weights, gradients, optimiser state and the log-softmax stay fp32).
    On a GPU, or a CPU with AVX-512 BF16 / AMX, the products are ~2x faster (on a CPU the
    attention then runs eager: its bf16 flash-attention backward is slower than fp32); the
    log-probs it trains on differ from the engine's fp32 ones by bf16 rounding, which the
    ratio sees as noise. ``fp32``: everything in fp32."""

    @model_validator(mode="after")
    def _off_policy_backend(self) -> "TrainerConfig":
        if self.backend == "megatron" and self.off_policy != "ppo_clip":
            raise ValueError(
                f"trainer.off_policy {self.off_policy!r} is implemented by the torch backend only; "
                "set trainer.backend: torch or trainer.off_policy: ppo_clip"
            )
        if self.backend == "megatron" and self.precision != "fp32":
            raise ValueError(
                f"trainer.precision {self.precision!r} is implemented by the torch backend only; "
                "set trainer.backend: torch or trainer.precision: fp32"
            )
        return self


class PolicyConfig(_Strict):
    """One policy: a model, its trainer and its weight stream."""

    name: str = "policy"
    """Policy id; names its weight stream and its buffer."""
    model: Path
    """HF model directory (a real checkpoint, or built by ``init`` when missing)."""
    init: ModelInit | None = None
    """Build the model locally if ``model`` does not exist. ``None``: the directory must exist."""
    trainer: TrainerConfig = TrainerConfig()
    """Trainer settings of this policy."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", v):
            raise ValueError("policy name must use letters, digits, '_', '.', '-' (it names directories)")
        return v


# -- workload ----------------------------------------------------------------------------------


class SamplingConfig(_Strict):
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature of training rollouts."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    max_new_tokens: int = Field(default=8, ge=1)
    """Token budget of one generation."""


class EvalConfig(_Strict):
    every: int = Field(default=10, ge=0)
    """Evaluate held-out accuracy every N trainer steps of the first policy (0: never), and
    before training."""
    num_prompts: int = Field(default=100, ge=1)
    """Held-out prompts per evaluation."""
    k: int = Field(default=1, ge=1)
    """Samples per prompt: avg@k and pass@k are reported; k=1 decodes greedily."""


class WorkloadConfig(_Strict):
    """What the RaaS nodes roll out (owned by ``astraflow.workloads``)."""

    name: str = "math"
    """Registered workload (dataset + reward)."""
    workflow: str = "single_turn"
    """Registered workflow driving the episode (``astraflow.workloads.workflows``)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Workload parameters (for math: ``digits``, ``ops``, ``num_train``, ``num_eval``; for
    ``mix``: ``sources: {name: {workload, weight, params}}``, mixed by weight)."""
    seed: int = 0
    """Seed of the generated dataset and of prompt order."""
    group_size: int = Field(default=8, ge=1)
    """Samples per prompt (a GRPO group)."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling of training rollouts."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation through the same RaaS path."""


# -- dataflow ----------------------------------------------------------------------------------


class PolicySpec(_Strict):
    """A dataflow policy chosen by registered name, with its own parameters."""

    type: str
    """Registered name of the policy class."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Constructor arguments of the policy."""


class DataflowConfig(_Strict):
    """The data layer (owned by ``astraflow.dataflow``)."""

    batch_size: int = Field(default=64, ge=1)
    """Sequences per trainer batch (whole groups: a multiple of ``workload.group_size``)."""
    max_staleness: int = Field(default=2, ge=0)
    """Sequences generated more than this many versions before the consuming trainer
    version are dropped (counted in the ledger as ``stale``)."""
    lease_seconds: float = Field(default=30.0, gt=0)
    """A leased task that is not completed or renewed by a heartbeat within this time is
    requeued."""
    max_attempts: int = Field(default=3, ge=1)
    """A task failed or expired this many times ends as failed."""
    prefetch_groups: int = Field(default=4, ge=0)
    """Groups leased ahead of what the trainers need (bounds staleness and wasted work)."""
    curator: PolicySpec = PolicySpec(type="accept_all")
    """Prompt curator before rollout."""
    group_filter: PolicySpec = PolicySpec(type="keep_all")
    """Group filter after rollout."""
    ordering: PolicySpec = PolicySpec(type="fifo")
    """Buffer ordering (``fifo``, ``edf`` or ``freshest``)."""
    replay_ratio: float = Field(default=0.0, ge=0, lt=1)
    """Fraction of each batch filled with recently consumed samples (recorded as replays)."""
    lockstep: bool = False
    """Multi-policy: policies advance in lockstep (a version barrier) instead of independently."""


# -- rollout -----------------------------------------------------------------------------------


class EngineConfig(_Strict):
    type: Literal["hf"] = "hf"
    """Inference engine: ``hf`` (transformers; CPU, or one GPU when available)."""
    max_batch: int = Field(default=64, ge=1)
    """Most requests decoded together in one batch."""
    swap_min_remaining: int = Field(default=16, ge=0)
    """A newer weight version that arrives while a batch decodes is applied between two
    decoding steps (partial rollout: the batch is re-encoded with the new weights) only while at
    least this many steps are left; nearer the end the batch finishes first. Re-encoding costs
    a prefill of every row: for short answers it costs more than the fresher tokens are worth.
    0: always at the next step."""
    threads: int = Field(default=1, ge=1)
    """torch intra-op threads of the engine."""
    process: bool = True
    """Run the engine in a process of its own, next to the node's Dask worker. The node's
    Python work (Dask comms, trajectory writes) then no longer competes with decoding for the
    interpreter lock (``benchmarks/rollout_overhead.py``). ``false``: in the worker process."""
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """Where the engine runs: ``auto`` (the worker's GPU when it has one, else the CPU),
    ``cpu``, ``cuda`` or ``cuda:N``."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """The engine's weights and forward passes. ``bf16`` decodes ~1.6x faster where the
    hardware has bf16 (GPUs; CPUs with AVX512-BF16 or AMX; elsewhere it is slower than fp32);
    its log-probs then differ slightly from the trainer's fp32 ones, which the loss's clipped
    importance ratio absorbs. Sampling and log-probs are computed from fp32 logits either way."""


class RolloutConfig(_Strict):
    """A RaaS node (owned by ``astraflow.rollout``)."""

    engine: EngineConfig = EngineConfig()
    """The inference engine of each policy on the node."""
    capacity: int = Field(default=32, ge=1)
    """Episodes in flight on one node. Above ``engine.max_batch`` (2x is a good start) the next
    batch already waits in the engine while one decodes, so the engine never idles for a lease
    round trip."""
    write_batch: int = Field(default=64, ge=1)
    """Trajectories buffered before a segment write (also flushed every ``flush_seconds``)."""
    flush_seconds: float = Field(default=0.5, gt=0)
    """Longest time a finished trajectory waits in the node before it is written."""
    lease_wait_seconds: float = Field(default=0.5, ge=0, le=5)
    """How long one lease call may wait in the data layer for tasks when it has none (a long
    poll: tasks reach the node the moment they exist, without a call every few ms)."""
    weight_poll_seconds: float = Field(default=0.5, gt=0)
    """How often the node checks the weight store for a newer version."""
    full_resync_every: int = Field(default=10, ge=1)
    """Load full shards instead of a delta every N versions."""
    engine_restarts: int = Field(default=3, ge=0)
    """How many times a node restarts an engine process that died (its in-flight episodes
    fail and are requeued; the new process loads the newest committed weights before the node
    leases again). After that the node stops leasing and reports the error."""


class StorageConfig(_Strict):
    trajectories: str | None = None
    """Trajectory store URL (directory or ``memory://``); default ``<run>/trajectories``."""
    keep_versions: int = Field(default=3, ge=1)
    """Weight versions kept per policy (held versions are never deleted)."""
    deltas: bool = False
    """Write a sparse bf16 delta ``v-1 -> v`` after every commit (off the training critical
    path) and let RaaS nodes that are one version behind apply it instead of loading full
    shards. Nodes then serve the bf16 view of the weights (as GPU engines do)."""


class ClusterConfig(_Strict):
    dashboard_port: int = Field(default=8787, ge=0, le=65535)
    """Dask dashboard port (0: any free port)."""
    dashboard_host: str = "127.0.0.1"
    """Address the dashboard binds to; the default keeps it on this machine."""
    worker_start_timeout_s: float = Field(default=180.0, gt=0)
    """Deadline for requested workers to join the scheduler."""
    placement_timeout_s: float = Field(default=120.0, gt=0)
    """Deadline for an actor to be constructed on its worker."""
    drain_timeout_s: float = Field(default=120.0, gt=0)
    """Deadline for a removed RaaS node to finish and write its in-flight episodes before its
    job is cancelled anyway (what it still holds is requeued)."""
    scheduler_host: str = "127.0.0.1"
    """Address the Dask scheduler listens on. The loopback default keeps a one-host run on this
    machine; on a cluster use the head node's address or set `scheduler_interface`."""
    scheduler_interface: str | None = None
    """Network interface the Dask scheduler listens on (e.g. ``ib0``); overrides `scheduler_host`."""
    worker_interface: str | None = None
    """Interface Slurm workers listen on (e.g. ``ib0``). None: the default route's, or
    ``127.0.0.1`` when the scheduler is on loopback (a one-host cluster)."""
    worker_python: str | None = None
    """Interpreter Slurm worker jobs run (a venv on the shared filesystem). None: the one
    running the orchestrator."""
    slurm_setup_lines: list[str] = Field(default_factory=list)
    """Shell lines every Slurm worker job runs before the worker (``module load ...``,
    ``source /shared/venv/bin/activate``)."""


class RunSection(_Strict):
    name: str = "run"
    """Name of the run (run directories default to ``runs/<name>-<timestamp>``)."""
    max_steps: int = Field(default=50, ge=1)
    """Trainer steps per policy; the run ends when every trainer has taken them."""
    seed: int = 0
    """Seed of trainers and engines."""
    mode: Literal["async", "sync"] = "async"
    """``async``: the three components run their own loops (AstraFlow). ``sync``: a
    trainer-centred driver loop, the baseline for comparisons."""
    timeout_s: float = Field(default=3600.0, gt=0)
    """Deadline of the whole run."""


def _default_partitions() -> list[Partition]:
    return [
        Partition(name="data", scheduler="local", role="data", nodes=1),
        Partition(name="trainer", scheduler="local", role="trainer", nodes=1),
        Partition(name="rollout", scheduler="local", role="rollout", nodes=2),
    ]


class RunConfig(_Strict):
    """A whole run. Each section goes only to the component that owns it."""

    run: RunSection = RunSection()
    policies: list[PolicyConfig]
    """The policies trained in this run (one trainer each)."""
    workload: WorkloadConfig = WorkloadConfig()
    dataflow: DataflowConfig = DataflowConfig()
    rollout: RolloutConfig = RolloutConfig()
    storage: StorageConfig = StorageConfig()
    cluster: ClusterConfig = ClusterConfig()
    partitions: list[Partition] = Field(default_factory=_default_partitions)
    """Worker pools. The embedded default: local data, trainer and two rollout workers."""

    @model_validator(mode="after")
    def _cross_checks(self) -> "RunConfig":
        if not self.policies:
            raise ValueError("policies: name at least one policy")
        names = [p.name for p in self.policies]
        if len(set(names)) != len(names):
            raise ValueError(f"policies: names must be unique, got {names}")
        if self.dataflow.batch_size % self.workload.group_size:
            raise ValueError(
                f"dataflow.batch_size ({self.dataflow.batch_size}) must be a multiple of "
                f"workload.group_size ({self.workload.group_size}): batches hold whole groups"
            )
        roles = {p.role for p in self.partitions}
        for role in ("data", "trainer", "rollout"):
            if role not in roles:
                raise ValueError(f"partitions: add a partition with role: {role}")
        pnames = [p.name for p in self.partitions]
        if len(set(pnames)) != len(pnames):
            raise ValueError(f"partitions: names must be unique, got {pnames}")
        from astraflow.workloads.base import workflow_class

        try:
            wf = workflow_class(self.workload.workflow)
        except (ValueError, ImportError) as err:
            raise ValueError(f"workload.workflow: {err}") from None
        need = getattr(wf, "num_policies", 1)
        if need != len(self.policies):
            raise ValueError(
                f"workload.workflow {self.workload.workflow!r} drives {need} policies but policies names "
                f"{len(self.policies)}: list one policy per role, in the workflow's order"
            )
        from astraflow.workloads.base import make_workload

        try:  # cheap: workloads generate their prompts lazily, in tasks()
            make_workload(self.workload.name, self.workload.params, self.workload.seed)
        except (ValueError, TypeError) as err:
            raise ValueError(f"workload ({self.workload.name}): {err}") from None
        for i, pol in enumerate(self.policies):
            base = pol.init.start_from if pol.init is not None else None
            if base is not None and base not in [p.name for p in self.policies[:i]]:
                raise ValueError(
                    f"policies[{pol.name}].init.start_from: {base!r} is not a policy listed before "
                    f"{pol.name!r}; name one of {[p.name for p in self.policies[:i]]} (models are built "
                    "in the order of `policies`)"
                )
            if pol.init is not None and pol.init.warm_starts and self.workload.name != "math":
                raise ValueError(
                    f"policies[{pol.name}].init.warm_start_seconds: the supervised warm start trains on "
                    f"the math workload's generator, not on workload {self.workload.name!r}; set it to 0 "
                    "(and drop warm_start_steps) or point model at a directory built by a math config"
                )
            if pol.init is None and not pol.model.exists():
                raise ValueError(
                    f"policies[{pol.name}].model: {pol.model} does not exist; point it at an HF "
                    "model directory or add an `init:` section to build one locally"
                )
            if pol.trainer.backend == "torch" and pol.trainer.tensor_parallel != 1:
                raise ValueError(
                    f"policies[{pol.name}].trainer: tensor_parallel > 1 needs backend: megatron"
                )
        return self

    def policy(self, name: str) -> PolicyConfig:
        for p in self.policies:
            if p.name == name:
                return p
        raise KeyError(name)


# -- loading -----------------------------------------------------------------------------------


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field and the fix."""


def _set_path(data: dict, dotted: str, value: Any) -> None:
    """Apply one ``--set a.b.c=value`` override; list elements are addressed by index or by
    ``name`` (``policies.solver.trainer.lr=1e-4``)."""
    parts = dotted.split(".")
    node: Any = data
    for i, key in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            idx = next((j for j, el in enumerate(node) if isinstance(el, dict) and el.get("name") == key), None)
            if idx is None and key.isdigit() and int(key) < len(node):
                idx = int(key)
            if idx is None:
                raise ConfigError(f"--set {dotted}: no list element named or numbered {key!r}")
            if last:
                node[idx] = value
            else:
                node = node[idx]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {'.'.join(parts[:i])} is not a section")
        if last:
            node[key] = value
        else:
            node = node.setdefault(key, {})


def parse_overrides(pairs: list[str]) -> list[tuple[str, Any]]:
    out = []
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set {pair!r}: use KEY=VALUE, e.g. --set run.max_steps=20")
        key, raw = pair.split("=", 1)
        out.append((key.strip(), yaml.safe_load(raw) if raw.strip() else ""))
    return out


def _format_validation(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; `astraflow config --help` lists the fields)"
        lines.append(f"{loc}: {msg}")
    return "invalid config:\n  " + "\n  ".join(lines)


def config_from_dict(data: dict, base_dir: Path | None = None) -> RunConfig:
    """Validate a config dict; relative model paths are resolved against ``base_dir``."""
    data = dict(data)
    if base_dir is not None:
        for pol in data.get("policies") or []:
            if isinstance(pol, dict) and "model" in pol and not Path(str(pol["model"])).is_absolute():
                pol["model"] = str((base_dir / str(pol["model"])).resolve())
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation(err)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config, apply ``--set`` overrides, validate.

    Relative model paths are resolved against the current directory (so examples run from
    the repository root, as the README shows).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found: pass the path of a YAML config, e.g. examples/math/config.yaml")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for key, value in parse_overrides(overrides or []):
        _set_path(data, key, value)
    return config_from_dict(data, base_dir=Path.cwd())


def dump_config(cfg: RunConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
