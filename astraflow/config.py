"""The run configuration: one YAML file, composed of the sections each package owns.

Each section's model lives next to what it configures (``astraflow/dataflow/config.py``,
``astraflow/rollout/config.py``, ``astraflow/training/config.py``,
``astraflow/workloads/config.py``, ``astraflow/sandbox/config.py``, ``storage/config.py``,
``schedulers/partition.py``) and each component receives only its own section, never the whole
config. The ``run``, ``cluster`` and ``autoscale`` sections configure the run as a whole
(``astraflow/sections.py``). Cross-component rules are validators whose message says how to fix
the file. ``load_config`` applies ``--set key=value`` overrides before validation, and the
resolved config is written into the run directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from astraflow.agents.workload import AgentParams, is_agentic
from astraflow.configerrors import (ConfigError, DuplicateKey, bool_problems, dotted_key, format_validation, load_yaml,
                                    model_of, yaml_problem)
from astraflow.configbase import Strict
from astraflow.configchecks import check_policy_inits, check_sandbox_deadlines, check_workflow, checked_workload
from astraflow.configpaths import resolve_paths, working_dir
from astraflow.dataflow.config import DataflowConfig
from astraflow.partition_settings import check_context_length, check_deltas, check_partition, effective_rollout
from astraflow.rollout.config import RolloutConfig
from astraflow.sandbox.config import SandboxConfig
from astraflow.training.config import PolicyConfig, sim_mismatch
from astraflow.workloads.config import WorkloadConfig
from astraflow.sections import (VLLM_PLACEMENT_TIMEOUT_S, AutoscaleConfig, ClusterConfig, RunSection,
                                check_autoscale)
from schedulers.partition import ROLES, Partition
from schedulers.policy import WorkerPolicy
from storage.atomic import write_atomically
from storage.config import StorageConfig


def _default_partitions() -> list[Partition]:
    return [
        Partition(name="data", scheduler="local", role="data", nodes=1),
        Partition(name="trainer", scheduler="local", role="trainer", nodes=1),
        Partition(name="rollout", scheduler="local", role="rollout", nodes=2),
    ]


def _multi_node_mismatch(field: str, tp: int, dp: int, part: Partition) -> str:
    """Why ``tp x dp`` ranks cannot run on multi-node trainer partition ``part``, and the fix."""
    world = part.ranks_per_worker
    per_node = f"gpus_per_node {part.gpus_per_node}" if part.gpus_per_node else "1 rank per node (no GPUs)"
    fix = (f"set {field}.data_parallel: {world // tp}" if world % tp == 0 else
           f"choose tensor_parallel x data_parallel = {world}")
    return (f"{field}: tensor_parallel {tp} x data_parallel {dp} = {tp * dp} ranks, but trainer partition "
            f"{part.name!r} spans nodes_per_worker {part.nodes_per_worker} x {per_node} = {world} ranks (one per "
            f"GPU on every node of its job): {fix}, or change the partition's nodes_per_worker / gpus_per_node "
            f"so that they multiply to {tp * dp}")


class RunConfig(Strict):
    """A whole run. Each section goes only to the component that owns it."""

    run: RunSection = RunSection()
    policies: list[PolicyConfig]
    """The policies trained in this run (one trainer each)."""
    workload: WorkloadConfig = WorkloadConfig()
    dataflow: DataflowConfig = DataflowConfig()
    rollout: RolloutConfig = RolloutConfig()
    storage: StorageConfig = StorageConfig()
    cluster: ClusterConfig = ClusterConfig()
    sandbox: SandboxConfig = SandboxConfig()
    """Where model-written code runs (the ``code`` workload's tests): bubblewrap, its limits and
    concurrency per RaaS node (docs/sandbox.md)."""
    partitions: list[Partition] = Field(default_factory=_default_partitions)
    """Worker pools. The embedded default: local data, trainer and two rollout workers."""
    autoscale: AutoscaleConfig | None = None
    """The autoscaler of the rollout partitions with ``autoscale:`` bounds (docs/autoscaling.md).
    None: none (a partition's bounds then need this section)."""

    def _check_agentic(self, workload: Any) -> None:
        """An agentic workload runs under the ``agent`` workflow, and its environments must
        fit the contract (a bad signature fails here, not in the run)."""
        from astraflow.agents.env import signature_problems, tools_problems

        wf, name = self.workload.workflow, self.workload.name
        if not is_agentic(type(workload)):
            if wf == "agent":
                raise ValueError(f"workload.workflow: 'agent' needs an agentic workload (one with "
                                 f"environment()); {name!r} has none: use single_turn")
            return
        if wf != "agent":
            raise ValueError(f"workload.workflow: {name!r} is an agentic workload; set workload.workflow: agent")
        params = getattr(workload, "params", None)
        if not isinstance(params, AgentParams):  # the episode limits the run and its nodes read
            raise ValueError(f"workload ({name}): its params are a {type(params).__name__}, not an "
                             "astraflow.agents.workload.AgentParams (max_turns, max_context_tokens, ...): "
                             "let its Params class extend AgentParams (docs/agents.md)")
        try:
            env = workload.environment()
        except Exception as err:
            raise ValueError(f"workload ({name}): environment() failed: {type(err).__name__}: {err}") from None
        problems = signature_problems(type(env)) + tools_problems(env)
        if problems:
            raise ValueError(f"workload ({name}): its environment does not fit the contract "
                             f"(astraflow.agents.env.Environment): {'; '.join(problems)}")
        # a model still to build learns from the expert's episodes: its warm start, its BPE tokenizer
        demos = [p for p in self.policies if p.init is not None and not p.model.exists() and not self.simulated(p)
                 and (p.init.warm_starts or p.init.tokenizer == "bpe")]
        if demos and not callable(getattr(env, "expert_action", None)):
            raise ValueError(f"policies[{demos[0].name}].init: a warm start or a bpe tokenizer learns from the "
                             f"environment's expert_action() demonstrations, and {type(env).__name__} ({name}) "
                             "has none: add it (docs/agents.md), or set warm_start_seconds: 0, drop "
                             "warm_start_steps and use tokenizer: byte")
        noisy = [p.name for p in self.policies if p.init is not None and p.init.demo_noise > 0]
        if noisy and not callable(getattr(env, "explore_action", None)):
            raise ValueError(f"policies[{noisy[0]}].init.demo_noise needs the environment's explore_action(rng) "
                             f"(a random plausible command), and {type(env).__name__} ({name}) has none: add it "
                             "(docs/agents.md) or set demo_noise: 0")

    def _check_can_learn(self) -> None:
        """Settings under which no step can change the weights, whatever the data."""
        if self.workload.group_size < 2:
            raise ValueError(
                f"workload.group_size: {self.workload.group_size} cannot train: GRPO's advantage is a reward "
                "minus its group's mean, 0 for a group of one (and the data layer keeps only groups of 2 or "
                "more, whatever dataflow.group_filter says); set workload.group_size: 2 or more")

    def _check_context_length(self, episode_tokens: int | None) -> None:
        """Every rollout partition's ``vllm`` engine holds a request (``check_context_length``)."""
        for part in self.partitions:
            check_context_length(part, self.rollout, self.workload.sampling.max_new_tokens, episode_tokens)

    def episode_tokens(self) -> int | None:
        """How long an agentic workload's episode grows (``workload.params.max_context_tokens``);
        None for a single-turn workload."""
        workload = checked_workload(self.workload)
        return workload.params.max_context_tokens if is_agentic(type(workload)) else None

    def check_added(self, part: Partition, episode_tokens: int | None) -> None:
        """``ValueError`` when partition ``part``, added to the running run (``astraflow partitions
        add``), does not fit this config: its settings (``check_partition``), and its engine's
        context length against the workload's requests (``episode_tokens``: `episode_tokens`), as
        the config's own partitions are judged."""
        check_partition(part, self.rollout, {p.name: p.trainer for p in self.policies})
        check_context_length(part, self.rollout, self.workload.sampling.max_new_tokens, episode_tokens)

    def _check_workers(self) -> None:
        """Worker counts a run cannot start with (one data-layer worker, a trainer one at least;
        rollout may start empty), and leases that do not outlive a few heartbeats of a RaaS node."""
        for role, why in (("data", "the data layer runs on exactly one worker"),
                          ("trainer", "the trainers need one worker at least")):
            parts = [p for p in self.partitions if p.role == role]
            total, names = sum(p.nodes for p in parts), ", ".join(f"{p.name!r} ({p.nodes})" for p in parts)
            if total < 1 or (role == "data" and total > 1):
                fix = "1 or more" if role == "trainer" else "1" + (" and 0 on the others" if len(parts) > 1 else "")
                raise ValueError(f"partitions: {why}, and the {role} partitions have {total} node(s) in all "
                                 f"({names}): set nodes: {fix} on partition {parts[0].name!r}")
        self._check_trainer_workers()
        problem = self.dataflow.node_lease_problem()
        if problem:
            raise ValueError(problem)

    def _check_trainer_workers(self) -> None:
        """One trainer worker per policy at most: each policy's trainer runs on one worker, and a
        lost one is replaced by a new worker, so a worker beyond the policies would only idle."""
        parts = [p for p in self.partitions if p.role == "trainer"]
        total, n = sum(p.nodes for p in parts), len(self.policies)
        if total <= n:
            return
        # the fix goes on the last partition with nodes: the ones before it keep theirs
        last = next(p for p in reversed(parts) if p.nodes > 0)
        keep = max(n - (total - last.nodes), 0)
        names = ", ".join(f"{p.name!r} ({p.nodes})" for p in parts)
        raise ValueError(
            f"partitions: the trainer partitions have {total} node(s) in all ({names}), and the run trains "
            f"{n} polic{'y' if n == 1 else 'ies'}: one trainer worker each (a lost one is replaced by a new "
            f"worker, so more would only idle); set nodes: {keep} on partition {last.name!r}"
            + (" and lower the others" if total - last.nodes > n else ""))

    def _check_store(self) -> None:
        """``storage.trajectories`` names a directory on this machine's file system (whether it
        can be created is checked with the machine, before a run starts: ``check_store_url``)."""
        if self.storage.trajectories is None:
            return
        from storage.trajectories.locations import store_url_problem

        problem = store_url_problem(self.storage.trajectories)
        if problem:
            raise ValueError(f"storage.trajectories: {problem}")

    def _check_trainer_ranks(self) -> None:
        """A Megatron trainer's ``tensor_parallel * data_parallel`` ranks take one GPU each on a
        GPU partition (exactly all of them on a multi-node one, whose world size is
        ``nodes_per_worker * gpus_per_node``), and every batch is split over its
        ``data_parallel`` replicas. Only Megatron trainers use more than one node."""
        multi = [p.name for p in self.partitions if p.role == "trainer" and p.nodes_per_worker > 1]
        for pol in self.policies:
            t = pol.trainer
            if t.backend != "megatron":
                if multi:
                    raise ValueError(
                        f"policies[{pol.name}].trainer: the {t.backend} backend trains on one node, and trainer "
                        f"partition(s) {multi} span several (nodes_per_worker > 1): set trainer.backend: megatron "
                        "or nodes_per_worker: 1")
                continue
            field = f"policies[{pol.name}].trainer"
            if self.dataflow.batch_size < t.data_parallel:
                raise ValueError(
                    f"{field}.data_parallel {t.data_parallel} splits every batch over that many replicas, and "
                    f"dataflow.batch_size is {self.dataflow.batch_size}: raise dataflow.batch_size to at least "
                    f"{t.data_parallel} or lower {field}.data_parallel")
            ranks = t.tensor_parallel * t.data_parallel
            for part in self.partitions:
                if part.role == "trainer" and part.nodes_per_worker > 1 and ranks != part.ranks_per_worker:
                    raise ValueError(_multi_node_mismatch(field, t.tensor_parallel, t.data_parallel, part))
                if part.role == "trainer" and part.nodes_per_worker == 1 and 0 < part.gpus_per_node < ranks:
                    raise ValueError(
                        f"{field}: tensor_parallel {t.tensor_parallel} x data_parallel {t.data_parallel} = "
                        f"{ranks} ranks, one GPU each, and partition {part.name!r} gives a trainer "
                        f"{part.gpus_per_node} GPU(s) per node: lower tensor_parallel or data_parallel, or "
                        f"set gpus_per_node: {ranks} on the trainer partition"
                        + (f", or span {ranks // part.gpus_per_node} nodes with nodes_per_worker: "
                           f"{ranks // part.gpus_per_node} (nodes counts trainer workers, not the nodes of one)"
                           if ranks % part.gpus_per_node == 0 else ""))

    @model_validator(mode="before")
    @classmethod
    def _vllm_start_deadline(cls, data: Any) -> Any:
        """Where a rollout engine (the run's, or a partition's own) is ``vllm`` and the config
        sets no ``cluster.placement_timeout_s``, its nodes get ``VLLM_PLACEMENT_TIMEOUT_S`` to
        start: a real model's vLLM start takes minutes, and past the deadline the worker is
        failed and refilled, over and over."""
        if not isinstance(data, dict) or not isinstance(data.get("cluster", {}), dict):
            return data
        if "placement_timeout_s" in data.get("cluster", {}):
            return data

        def engine_type(rollout: Any) -> Any:
            engine = rollout.get("engine") if isinstance(rollout, dict) else None
            return engine.get("type") if isinstance(engine, dict) else None

        parts = data.get("partitions") if isinstance(data.get("partitions"), list) else []
        types = {engine_type(data.get("rollout"))} | {
            engine_type(p.get("rollout") if isinstance(p, dict) else getattr(p, "rollout", None)) for p in parts}
        if "vllm" not in types:
            return data
        return {**data, "cluster": {**data.get("cluster", {}), "placement_timeout_s": VLLM_PLACEMENT_TIMEOUT_S}}

    @model_validator(mode="after")
    def _engine_fits_rollout_gpus(self) -> "RunConfig":
        """A ``vllm`` engine's ``tensor_parallel`` shards take one GPU each of a rollout worker; a
        partition's own ``rollout:`` settings replace the run's for its workers."""
        for part in self.partitions:
            if part.role != "rollout":
                continue
            tp = effective_rollout(self.rollout, part).engine.tensor_parallel
            if 0 < part.gpus_per_node < tp:
                own = "tensor_parallel" in part.rollout.get("engine", {})
                field = f"partitions[{part.name}].rollout" if own else "rollout"
                raise ValueError(
                    f"{field}.engine.tensor_parallel {tp} shards each engine over {tp} GPUs, and partition "
                    f"{part.name!r} gives a rollout worker {part.gpus_per_node}: lower tensor_parallel or set "
                    f"gpus_per_node: {tp} on that partition")
        return self

    @model_validator(mode="after")
    def _cross_checks(self) -> "RunConfig":
        if not self.policies:
            raise ValueError("policies: name at least one policy")
        names = [p.name for p in self.policies]
        if len(set(names)) != len(names):
            raise ValueError(f"policies: names must be unique, got {names}")
        self._check_can_learn()
        if self.dataflow.batch_size % self.workload.group_size:
            raise ValueError(
                f"dataflow.batch_size ({self.dataflow.batch_size}) must be a multiple of "
                f"workload.group_size ({self.workload.group_size}): batches hold whole groups"
            )
        roles = {p.role for p in self.partitions}
        for role in ROLES:
            if role not in roles:
                raise ValueError(f"partitions: add a partition with role: {role}")
        pnames = [p.name for p in self.partitions]
        if len(set(pnames)) != len(pnames):
            raise ValueError(f"partitions: names must be unique, got {pnames}")
        self._check_workers()
        self._check_store()
        policy = WorkerPolicy.of(self.cluster.worker_env_allowlist, self.cluster.sbatch_options_allowlist)
        problems = [line for p in self.partitions for line in policy.problems(p)]
        if problems:
            raise ValueError("\n  ".join(problems))
        for pol in self.policies:  # the run's engine first; then each partition's own (check_partition)
            problem = sim_mismatch("rollout.engine.type", self.rollout.engine.type,
                                   f"policies[{pol.name}].trainer.backend", pol.trainer.backend)
            if problem:
                raise ValueError(problem)
        for part in self.partitions:
            check_partition(part, self.rollout, {p.name: p.trainer for p in self.policies})
        self._check_trainer_ranks()
        check_deltas(self.storage.deltas, self.rollout, self.partitions, self.policies)
        check_autoscale(self.autoscale, self.partitions, self.run.mode)
        check_workflow(self.workload.workflow, len(self.policies))
        workload = checked_workload(self.workload)
        self._check_agentic(workload)
        check_sandbox_deadlines(workload, self.sandbox, self.rollout.reward_timeout_s)
        agentic = is_agentic(type(workload))
        self._check_context_length(workload.params.max_context_tokens if agentic else None)
        check_policy_inits(self.policies, workload, self.workload.name, agentic, self.simulated)
        return self

    def simulated(self, pol: PolicyConfig) -> bool:
        """Whether ``pol`` runs without a model: sim engines and a sim trainer (``docs/sim.md``);
        its ``model`` is then only a name."""
        return self.rollout.engine.type == "sim" and pol.trainer.backend == "sim"

    def policy(self, name: str) -> PolicyConfig:
        for p in self.policies:
            if p.name == name:
                return p
        raise KeyError(name)


# -- loading -----------------------------------------------------------------------------------


def _default_data(model: type[BaseModel] | None, key: str) -> Any:
    """The default of field ``key`` of ``model`` as the plain data a config file would hold, for
    a ``--set`` into a section the file does not write: a list of sections (``partitions``)
    keeps its default elements, so they can be addressed by name. ``{}`` otherwise."""
    field = model.model_fields.get(key) if model is not None else None
    if field is None:
        return {}
    default = field.get_default(call_default_factory=True)
    if isinstance(default, list) and all(isinstance(el, BaseModel) for el in default):
        return [el.model_dump(mode="json", exclude_unset=True) for el in default]
    if isinstance(default, BaseModel):  # with its ``type`` even at its default: a rule's union tells members by it
        typed = {"type": default.model_dump(mode="json")["type"]} if "type" in type(default).model_fields else {}
        return {**typed, **default.model_dump(mode="json", exclude_unset=True)}
    return {}


def _set_path(data: dict, dotted: str, value: Any, model: type[BaseModel] | None = RunConfig) -> None:
    """Apply one ``--set a.b.c=value`` override; list elements are addressed by index or by
    ``name`` (``policies.solver.trainer.lr=1e-4``), also in a list the file leaves at its
    default (``partitions.rollout.nodes=4``). ``model`` is the config type of ``data``."""
    parts = dotted.split(".")
    node: Any = data
    for i, key in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            idx = next((j for j, el in enumerate(node) if isinstance(el, dict) and el.get("name") == key), None)
            if idx is None and key.isdigit() and int(key) < len(node):
                idx = int(key)
            if idx is None:
                names = [str(el["name"]) for el in node if isinstance(el, dict) and "name" in el]
                raise ConfigError(f"--set {dotted}: no list element named or numbered {key!r} in "
                                  f"{'.'.join(parts[:i])}" + (f" (it has {', '.join(names)})" if names else ""))
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
            if key not in node:
                node[key] = _default_data(model, key)
            elif isinstance(node[key], str) and model is DataflowConfig and "type" in _default_data(model, key):
                node[key] = {"type": node[key]}  # a rule named alone (``ordering: edf``): its section
            field = model.model_fields.get(key) if model is not None else None
            model = model_of(field.annotation) if field is not None else None
            node = node[key]


def parse_overrides(pairs: list[str]) -> list[tuple[str, Any]]:
    out = []
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set {pair!r}: use KEY=VALUE, e.g. --set run.max_steps=20")
        key, raw = pair.split("=", 1)
        key = dotted_key(key.strip())
        if not key or "" in key.split("."):
            raise ConfigError(f"--set {pair!r}: {key!r} is not a dotted key; use KEY=VALUE, "
                              "e.g. --set run.max_steps=20")
        try:
            value = load_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError as err:
            why = str(getattr(err, "problem", None) or err).splitlines()[0]
            raise ConfigError(f"--set {pair!r}: the value is not valid YAML ({why}); quote it, "
                              f"e.g. --set '{key}=\"...\"'") from None
        out.append((key, value))
    return out


def config_from_dict(data: dict, base_dir: Path | None = None) -> RunConfig:
    """Validate a config dict; relative paths are resolved against ``base_dir`` (`resolve_paths`)."""
    data = dict(data)
    policies = data.get("policies")
    for i, pol in enumerate(policies if isinstance(policies, list) else []):
        if isinstance(pol, dict) and "model" in pol and pol["model"] in (None, ""):  # not "None", not the cwd
            raise ConfigError(f"policies[{pol.get('name', i)}].model: empty; give the path of an HF model "
                              "directory (built by `init:` when missing), or a name for a sim run")
    if base_dir is not None:
        resolve_paths(data, base_dir)
    bools = bool_problems(data, RunConfig)
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation(err, bools, RunConfig, data)) from None
    if bools:
        raise ConfigError(format_validation(None, bools))
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config, apply ``--set`` overrides, validate.

    Relative paths (models, data, the trajectory store, TLS files, the sandbox's scratch root)
    are resolved against the current directory (so examples run from the repository root, as
    the README shows).
    """
    path, base_dir = Path(path), working_dir()
    if not path.is_file():
        raise ConfigError(f"config file {path} not found: pass the path of a YAML config, "
                          "e.g. examples/math/config.yaml")
    try:
        data = load_yaml(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); "
                          "save the config as UTF-8") from None
    except OSError as err:
        raise ConfigError(f"config file {path} cannot be read: {err.strerror or err}; check its permissions") from None
    except DuplicateKey as err:
        raise ConfigError(f"{path}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML at {yaml_problem(err)}; fix the file there") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for key, value in parse_overrides(overrides or []):
        _set_path(data, key, value)
    return config_from_dict(data, base_dir=base_dir)


def dump_config(cfg: RunConfig, path: Path) -> None:
    """Write the resolved config (``<run>/config.yaml``) atomically and durably."""
    write_atomically(path, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
