"""What a pool of workers is: the `Partition` record and the worker names derived from it.

The orchestrator keeps a *desired* set of partitions (from the config and from `astraflow
partitions add/remove`) and asks a `Scheduler` to start or stop workers for them. It then places
actors on workers **by name**, so the name must say everything placement needs: role, partition,
region, hardware and index. `worker_name` builds that name and `parse_worker_name` reads it back;
they are the only two functions that know the format.

A Partition is validated once, when it is built, with messages that say what to change.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, get_args

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, WrapValidator, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

SchedulerKind = Literal["local", "slurm"]
Role = Literal["rollout", "trainer", "data"]
ROLES: tuple[str, ...] = get_args(Role)

# '-' separates the fields of a worker name, so name/region/hardware may not contain it.
_LABEL_RE = r"^[A-Za-z0-9][A-Za-z0-9_.]{0,39}$"
_LABEL = re.compile(_LABEL_RE)
_IDENT = r"^[A-Za-z_][A-Za-z0-9_]*$"
_MEM = re.compile(r"^(\d+)([KMGT]?)$")
_GRES_ITEM_RE = r"([A-Za-z_][A-Za-z0-9_]*)(?::([A-Za-z0-9_.-]+?))?(?::(\d+))?"


def gres_gpus(gres: str) -> int | None:
    """GPUs a Slurm ``--gres`` list asks for per node: its ``gpu`` item's count (``gpu:4``,
    ``gpu:h100:4``; ``gpu`` or ``gpu:h100`` alone: 1), None without a ``gpu`` item."""
    for item in gres.split(","):
        name, *rest = item.split(":")
        if name == "gpu":
            return int(rest[-1]) if rest and rest[-1].isdigit() else 1
    return None


_WALLTIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")

#: the errors of a field's own constraint (``ge``, ``pattern``, ...), which `_fix` rewords
_CONSTRAINT_ERRORS = frozenset({"greater_than_equal", "string_pattern_mismatch", "finite_number"})


def _fix(message: str) -> WrapValidator:
    """Word a field's constraint failure as ``message``, which says what to change
    (``{field}``: the field's name, ``{value}``: the rejected value); other errors (a wrong
    type) keep pydantic's words."""

    def wrap(value: Any, handler: Any, info: ValidationInfo) -> Any:
        try:
            return handler(value)
        except ValidationError as err:
            if not all(e["type"] in _CONSTRAINT_ERRORS for e in err.errors()):
                raise
            raise PydanticCustomError("partition_field", message,
                                      {"field": info.field_name or "", "value": repr(value)}) from None

    return WrapValidator(wrap)


#: a part of every worker name
Label = Annotated[str, Field(pattern=_LABEL_RE), _fix(
    "{field} {value} is not usable in worker names: use 1-40 letters, digits, '_' or '.', starting with a "
    "letter or digit (no '-': it separates name fields)")]
Count = Annotated[int, Field(ge=0), _fix("{field} is {value}: use 0 or more")]
SlurmPartitionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$"), _fix(
    "slurm_partition {value}: use the name `sinfo` shows (letters, digits, '_', '.', '-')")]
Mem = Annotated[str, Field(pattern=r"^\d+[KMGT]?$"), _fix(
    "mem {value}: use a number with an optional K/M/G/T suffix, e.g. '4G' or '4096M' (0: all of a node's memory)")]
Gres = Annotated[str, Field(pattern=rf"^{_GRES_ITEM_RE}(?:,{_GRES_ITEM_RE})*$"), _fix(
    "gres {value}: use Slurm's 'name[:type][:count]' list, e.g. 'gpu:h100:4' or 'gpu:2'")]
ResourceName = Annotated[str, Field(pattern=_IDENT), _fix(
    "resource name {value}: use letters, digits and '_' (e.g. 'rollout', 'GPU')")]
ResourceAmount = Annotated[float, Field(ge=0, allow_inf_nan=False), _fix(
    "resource amount {value}: use a finite amount >= 0")]
EnvName = Annotated[str, Field(pattern=_IDENT), _fix(
    "env variable name {value}: use letters, digits and '_', not starting with a digit")]
# sbatch reads ``#SBATCH`` lines itself, splitting at blanks and treating quotes, '\' and '#'
# specially: a value made of other printable characters is read exactly as written.
SbatchOption = Annotated[str, Field(pattern=r"^--[a-z][a-z0-9-]*(=[A-Za-z0-9_.,:;=+@%&|!*/()\[\]{}<>^~?-]+)?$"), _fix(
    "sbatch option {value}: write it as '--option=value' (or '--flag') on one line, the value without "
    "blanks, quotes, '\\', '#', '$' or '`' (sbatch reads #SBATCH lines itself)")]
EnvValue = Annotated[str, Field(pattern=r"^[^\x00]*$"), _fix("env value {value}: remove the NUL character")]

# Options the worker template renders from Partition fields: setting them again is an error.
MANAGED_SBATCH_OPTIONS: dict[str, str] = {
    "--job-name": "the worker name and the run's tag (derived)",
    "--partition": "slurm_partition",
    "--nodes": "nodes_per_worker",
    "--ntasks": "one task per worker (derived)",
    "--ntasks-per-node": "gpus_per_node (a multi-node trainer's ranks per node)",
    "--cpus-per-task": "cpus_per_node",
    "--gres": "gres / gpus_per_node",
    "--gpus": "gres / gpus_per_node",
    "--mem": "mem",
    "--time": "walltime",
    "--output": "the job directory (derived)",
    "--error": "the job directory (derived)",
    "--comment": "the scheduler tag (derived)",
    "--parsable": "always passed by the scheduler",
}


def walltime_seconds(walltime: str) -> int | None:
    """Seconds in a Slurm time limit; None for ``INFINITE``/``UNLIMITED``.

    Accepts Slurm's forms: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``.
    Raises ValueError for anything else.
    """
    if walltime.upper() in ("INFINITE", "UNLIMITED"):
        return None
    m = _WALLTIME.fullmatch(walltime)
    if not m:
        raise ValueError(
            f"walltime {walltime!r} is not a Slurm time limit: use 'HH:MM:SS' (e.g. '01:00:00'), "
            "'MM', 'MM:SS', 'D-HH', 'D-HH:MM' or 'D-HH:MM:SS'"
        )
    days, a, b, c = m.groups()
    if days is not None:  # D-H[:M[:S]]
        h, mi, s = int(a), int(b or 0), int(c or 0)
        parts = [(mi, "minutes"), (s, "seconds")]
        if h >= 24:
            raise ValueError(f"walltime {walltime!r}: hours must be < 24 after the day count")
        total = int(days) * 86400 + h * 3600 + mi * 60 + s
    elif c is not None:  # H:M:S
        h, mi, s = int(a), int(b), int(c)
        parts = [(mi, "minutes"), (s, "seconds")]
        total = h * 3600 + mi * 60 + s
    elif b is not None:  # M:S
        mi, s = int(a), int(b)
        parts = [(s, "seconds")]
        total = mi * 60 + s
    else:  # M
        parts = []
        total = int(a) * 60
    for value, what in parts:
        if value >= 60:
            raise ValueError(f"walltime {walltime!r}: {what} must be < 60")
    if total <= 0:
        raise ValueError(f"walltime {walltime!r} is zero: give a positive time limit such as '01:00:00'")
    return total


def mem_to_dask(mem: str) -> str:
    """Slurm memory (``4G``, ``4096M``, ``4096`` = MiB) as a Dask ``--memory-limit`` string; ``0``
    (Slurm: all of the node's memory) is Dask's ``auto`` (what the worker's machine or job has)."""
    m = _MEM.fullmatch(mem)
    assert m, f"unvalidated mem {mem!r}"
    number, unit = m.groups()
    return "auto" if int(number) == 0 else f"{int(number)}{(unit or 'M')}iB"


class AutoscaleBounds(BaseModel):
    """How far the run's autoscaler may move a rollout partition's ``nodes`` (its workers),
    and how often (``autoscale:`` in the run's config holds the signal and its band; the
    orchestrator's ``astraflow.runtime.autoscale`` decides)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    min_nodes: Count = 1
    """Fewest workers the autoscaler drains the partition down to."""
    max_nodes: Annotated[int, Field(ge=1), _fix("max_nodes is {value}: use 1 or more")]
    """Most workers the autoscaler grows the partition up to."""
    cooldown_s: Annotated[float, Field(ge=0, allow_inf_nan=False), _fix(
        "cooldown_s is {value}: use a finite number of seconds >= 0")] = 30.0
    """Seconds after a change of this partition before the autoscaler changes it again."""

    @model_validator(mode="after")
    def _ordered(self) -> "AutoscaleBounds":
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"autoscale: min_nodes {self.min_nodes} is above max_nodes {self.max_nodes}: "
                             "make min_nodes <= max_nodes")
        return self


class Partition(BaseModel):
    """A named pool of identical workers, started by one scheduler backend.

    Written by the config loader and by `astraflow partitions add`; read by the orchestrator
    (desired state), by the schedulers (what to start) and by placement (through worker names).
    One worker = one process = one Slurm job (or one local subprocess); the job has one node,
    except a trainer's with ``nodes_per_worker`` > 1, whose Megatron ranks span them all.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    name: Label
    """Pool name, unique in a run; part of every worker name. Letters, digits, '_' and '.'
    (no '-': it separates the fields of a worker name)."""

    scheduler: SchedulerKind = "local"
    """Backend that starts the workers: ``local`` (subprocesses on this machine) or ``slurm``."""

    slurm_partition: SlurmPartitionName | None = None
    """Slurm partition the jobs go to (``--partition``). Must be None for ``local``; None for
    ``slurm`` means the cluster's default partition."""

    nodes: Count = 1
    """How many workers (= Slurm jobs, one node each) the pool should have. 0 = an empty pool."""

    nodes_per_worker: Annotated[int, Field(ge=1), _fix("nodes_per_worker is {value}: use 1 or more")] = 1
    """Slurm nodes in each worker's job. More than 1 only for a ``trainer`` partition on
    ``slurm``: the job asks for ``--nodes`` this many with ``--ntasks-per-node`` =
    `gpus_per_node` (1 without GPUs), the Dask worker runs once, on the first node, and a
    Megatron trainer starts its ranks over all of them (``srun``), so ``tensor_parallel x
    data_parallel`` must equal ``nodes_per_worker x gpus_per_node`` (`ranks_per_worker`).
    `nodes` stays the number of workers (jobs)."""

    cpus_per_node: Annotated[int, Field(ge=1), _fix("cpus_per_node is {value}: use 1 or more")] = 1
    """CPUs per worker (``--cpus-per-task``); also the worker's thread count unless `nthreads` is set."""

    gpus_per_node: Count = 0
    """GPUs per worker. Added to the worker resources as ``GPU``; for Slurm, rendered as
    ``--gres=gpu:N`` when `gres` is not given."""

    gres: Gres | None = None
    """Slurm generic resources per node, e.g. ``gpu:h100:4`` (comma-separated list allowed).
    Slurm only. Its gpu count must equal `gpus_per_node` when both are set."""

    mem: Mem | None = None
    """Memory per node in Slurm syntax (``4G``, ``4096M``; a bare number is MiB; ``0``: all of the
    node's memory); also the Dask worker's memory limit. None = Slurm's default and Dask's ``auto``."""

    walltime: str = "01:00:00"
    """Slurm time limit (``--time``), e.g. ``01:00:00`` or ``2-00:00:00``. Ignored by ``local``."""

    region: Label = "local"
    """Where the pool runs (site or cloud region label): part of the worker name and of each
    trajectory's provenance; a label only, nothing is placed or routed by it. Letters, digits,
    '_' and '.'."""

    hardware: Label = "cpu"
    """Hardware label (``H100``, ``A100``, ``cpu``), part of the worker name; with sim engines a
    label naming a preset (``h100``, ``a100``, case aside) gives the pool that preset's timing
    (``docs/sim.md``). Letters, digits, '_' and '.'."""

    role: Role = "rollout"
    """What the workers host: ``rollout`` (RaaS nodes), ``trainer`` or ``data`` (data layer)."""

    resources: dict[ResourceName, ResourceAmount] = Field(default_factory=dict)
    """Dask worker resources (``--resources``). Empty = ``{role: 1}``; see `worker_resources`."""

    nthreads: Annotated[int, Field(ge=1), _fix(
        "nthreads is {value}: use 1 or more, or leave it unset to use cpus_per_node")] | None = None
    """Dask worker threads. None = `cpus_per_node`."""

    sbatch_options: tuple[SbatchOption, ...] = ()
    """Extra ``#SBATCH`` lines as ``--opt=value`` (e.g. ``--account=proj``, ``--qos=high``).
    Slurm only; may not repeat an option rendered from a field (``--time``: use `walltime`); names
    must be in the run's ``cluster.sbatch_options_allowlist`` (see `schedulers.policy`)."""

    rollout: dict[str, Any] = Field(default_factory=dict)
    """Rollout settings of this partition's RaaS nodes over the run's ``rollout`` section, in
    its shape (``{capacity: 256, engine: {max_batch: 128}}``): for pools whose hardware differs.
    Role ``rollout`` only; validated by the run config (``astraflow.partition_settings``)."""

    trainer: dict[str, Any] = Field(default_factory=dict)
    """Trainer settings of the trainers this partition hosts over each policy's ``trainer``
    section (its hardware fields: ``micro_batch``, ``threads``, ``device``). Role ``trainer``
    only; validated by the run config (``astraflow.partition_settings``)."""

    env: dict[EnvName, EnvValue] = Field(default_factory=dict)
    """Environment variables set for the worker process (both backends). Names must be in the
    run's ``cluster.worker_env_allowlist`` (see `schedulers.policy`)."""

    autoscale: AutoscaleBounds | None = None
    """Bounds within which the run's autoscaler may change `nodes` (``{min_nodes, max_nodes,
    cooldown_s}``; role ``rollout`` only, and `nodes` must lie within them). None: only
    ``astraflow partitions`` changes this partition. See docs/autoscaling.md."""

    # ------------------------------------------------------------------ field checks
    @field_validator("walltime")
    @classmethod
    def _walltime(cls, v: str) -> str:
        walltime_seconds(v)
        return v

    @field_validator("sbatch_options")
    @classmethod
    def _sbatch_options(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for opt in v:
            key = opt.split("=", 1)[0]
            if key in MANAGED_SBATCH_OPTIONS:
                raise ValueError(
                    f"sbatch option {opt!r} is rendered from the partition: set {MANAGED_SBATCH_OPTIONS[key]} instead"
                )
        return v

    # ------------------------------------------------------------------ cross-field checks
    @model_validator(mode="after")
    def _consistent(self) -> "Partition":
        if self.scheduler == "local":
            slurm_only = {
                "slurm_partition": self.slurm_partition is not None,
                "gres": self.gres is not None,
                "sbatch_options": bool(self.sbatch_options),
            }
            for field, is_set in slurm_only.items():
                if is_set:
                    raise ValueError(
                        f"partition {self.name!r}: {field} is a Slurm setting but scheduler is 'local': "
                        f"remove {field} or set scheduler: slurm"
                    )
        if self.nodes_per_worker > 1 and (self.scheduler != "slurm" or self.role != "trainer"):
            raise ValueError(
                f"partition {self.name!r}: nodes_per_worker {self.nodes_per_worker} spans Slurm nodes for a "
                f"multi-node Megatron trainer; this one is a {self.scheduler} {self.role} partition: set "
                "nodes_per_worker: 1, or use it on a scheduler: slurm, role: trainer partition")
        if self.autoscale is not None:
            b = self.autoscale
            if self.role != "rollout":
                raise ValueError(f"partition {self.name!r}: autoscale moves RaaS nodes; this is a {self.role} "
                                 "partition: remove its autoscale section")
            if not b.min_nodes <= self.nodes <= b.max_nodes:
                raise ValueError(f"partition {self.name!r}: nodes {self.nodes} is outside its autoscale bounds "
                                 f"[{b.min_nodes}, {b.max_nodes}]: set nodes between min_nodes and max_nodes")
        given = {opt.split("=", 1)[0] for opt in self.sbatch_options}
        if self.mem is not None and given & {"--mem-per-cpu", "--mem-per-gpu"}:
            raise ValueError(
                f"partition {self.name!r}: mem {self.mem} and sbatch option "
                f"{sorted(given & {'--mem-per-cpu', '--mem-per-gpu'})[0]} both set the job's memory (sbatch refuses "
                "them together): keep one")
        if (self.gpus_per_node or self.gres is not None) and "--gpus-per-task" in given:
            raise ValueError(
                f"partition {self.name!r}: sbatch option --gpus-per-task and the partition's GPU request (gres / "
                "gpus_per_node) ask for GPUs twice (sbatch finds no node for both): set gpus_per_node only")
        if self.gres is not None:
            asked = gres_gpus(self.gres)
            if asked is not None and asked != self.gpus_per_node:
                raise ValueError(
                    f"partition {self.name!r}: gres {self.gres!r} asks for {asked} GPU(s) but "
                    f"gpus_per_node is {self.gpus_per_node}: make them equal (the worker advertises "
                    "gpus_per_node GPUs)")
            if asked is None and self.gpus_per_node:
                raise ValueError(
                    f"partition {self.name!r}: gres {self.gres!r} asks for no GPU but gpus_per_node is "
                    f"{self.gpus_per_node} (gres replaces the GPU request): add gpu:{self.gpus_per_node} to gres")
        return self

    # ------------------------------------------------------------------ derived values
    @property
    def worker_resources(self) -> dict[str, float]:
        """Resources every worker advertises: `resources` (or ``{role: 1}``) plus ``GPU``."""
        res = dict(self.resources) if self.resources else {self.role: 1.0}
        if self.gpus_per_node and "GPU" not in res:
            res["GPU"] = float(self.gpus_per_node)
        return res

    @property
    def ranks_per_node(self) -> int:
        """Trainer ranks on each node of a multi-node worker's job: one per GPU (1 without GPUs)."""
        return max(self.gpus_per_node, 1)

    @property
    def ranks_per_worker(self) -> int:
        """The world size of a multi-node trainer worker: ``nodes_per_worker x ranks_per_node``."""
        return self.nodes_per_worker * self.ranks_per_node

    @property
    def worker_threads(self) -> int:
        """Threads per Dask worker."""
        return self.nthreads if self.nthreads is not None else self.cpus_per_node

    @property
    def worker_memory_limit(self) -> str:
        """The Dask ``--memory-limit`` derived from `mem` (``auto`` when unset)."""
        return mem_to_dask(self.mem) if self.mem is not None else "auto"


def worker_name(partition: Partition, index: int) -> str:
    """The name of worker number `index` of `partition`: ``role-partition-region-hardware-index``.

    Example: ``rollout-h100-eu-H100-0``. Placement pins actors to workers by this name.
    """
    if index < 0:
        raise ValueError(f"worker index {index}: use 0 or more")
    return f"{partition.role}-{partition.name}-{partition.region}-{partition.hardware}-{index}"


def parse_worker_name(name: str) -> dict[str, str | int]:
    """Inverse of `worker_name`: ``{"role", "partition", "region", "hardware", "index"}``.

    Raises ValueError for a name that `worker_name` cannot have produced.
    """
    fields = name.split("-")
    if len(fields) != 5:
        raise ValueError(f"worker name {name!r} is not 'role-partition-region-hardware-index'")
    role, part, region, hardware, index = fields
    if role not in ROLES or not index.isdigit() or not all(_LABEL.fullmatch(x) for x in (part, region, hardware)):
        raise ValueError(f"worker name {name!r} is not 'role-partition-region-hardware-index' (role one of {ROLES})")
    return {"role": role, "partition": part, "region": region, "hardware": hardware, "index": int(index)}
