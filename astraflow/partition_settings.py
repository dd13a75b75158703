"""Per-partition settings: a partition's ``rollout:`` and ``trainer:`` mappings, merged over the
run's sections for the workers it hosts (pools whose hardware differs: larger batches on
H100s than on A100s, more engine threads on a many-core CPU pool).

A partition's ``rollout:`` has the shape of the ``rollout`` section (any of its fields, nested
ones included); its ``trainer:`` holds only the fields of a policy's ``trainer`` section that
follow the hardware (``TRAINER_FIELDS``): the rest changes what a trainer learns, and a
trainer restarted on another pool must learn the same way. The merged sections are validated
as the run's are; an unknown key is an error naming the keys allowed there.

`Partition` (``schedulers``, which never imports AstraFlow) carries the mappings as plain
data; this module is where they get their types. The run config checks them when it loads,
``astraflow partitions add`` against the running run's saved config, and placement merges them
when it builds a RaaS node or a trainer on a worker of the partition.
"""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import BaseModel, ValidationError

from astraflow.configerrors import bool_problems
from astraflow.rollout.config import RolloutConfig
from astraflow.rollout.sim_config import PRESETS
from astraflow.training.config import TrainerConfig, sim_mismatch
from schedulers.partition import Partition

#: the trainer fields a partition may set: they follow the hardware, not what is learnt
TRAINER_FIELDS: tuple[str, ...] = ("micro_batch", "threads", "device")


def effective_rollout(base: RolloutConfig, part: Partition | None) -> RolloutConfig:
    """The ``rollout`` section of the RaaS nodes of ``part``: ``base`` with its settings over it.
    Sim engines take the preset a partition's ``hardware`` label names (``sim_hardware``)."""
    if part is None:
        return base
    cfg = _merged(base, part.rollout, f"partitions[{part.name}].rollout", None) if part.rollout else base
    hw = sim_hardware(part)
    if cfg.engine.type == "sim" and hw is not None and hw != cfg.engine.sim.hardware:
        sim = cfg.engine.sim.model_copy(update={"hardware": hw})
        cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"sim": sim})})
    return cfg


def sim_hardware(part: Partition) -> str | None:
    """The sim preset a partition's ``hardware`` label names (``H100`` -> ``h100``), unless it is
    the default label (``cpu``) or the partition sets ``rollout.engine.sim.hardware`` itself."""
    label = part.hardware.lower()
    if label == "cpu" or label not in PRESETS or "hardware" in part.rollout.get("engine", {}).get("sim", {}):
        return None
    return label


def effective_trainer(base: TrainerConfig, part: Partition | None) -> TrainerConfig:
    """A policy's ``trainer`` section on a worker of ``part``: ``base`` with its settings over it."""
    if part is None or not part.trainer:
        return base
    return _merged(base, part.trainer, f"partitions[{part.name}].trainer", TRAINER_FIELDS)


def check_context_length(part: Partition, rollout: RolloutConfig, new_tokens: int, episode_tokens: int | None) -> None:
    """A ``vllm`` engine's ``max_model_len`` on ``part`` must hold a prompt (a token at least) and
    ``new_tokens`` (``workload.sampling.max_new_tokens``), and an agentic episode's
    ``episode_tokens`` (``workload.params.max_context_tokens``: its last turns' requests grow
    to it): the engine refuses every longer request."""
    engine = effective_rollout(rollout, part).engine if part.role == "rollout" else None
    limit = engine.vllm.max_model_len if engine is not None and engine.type == "vllm" else None
    if limit is None:
        return
    own = "max_model_len" in part.rollout.get("engine", {}).get("vllm", {})
    field = f"{f'partitions[{part.name}].rollout' if own else 'rollout'}.engine.vllm.max_model_len {limit}"
    if limit <= new_tokens:
        raise ValueError(
            f"{field}: a request is its prompt plus workload.sampling.max_new_tokens {new_tokens} tokens, which "
            f"does not fit; raise max_model_len to at least {new_tokens} plus the longest prompt, or lower "
            "workload.sampling.max_new_tokens")
    if episode_tokens is not None and limit < episode_tokens:
        raise ValueError(
            f"{field}: an episode's requests grow to workload.params.max_context_tokens "
            f"{episode_tokens} tokens, which do not fit; raise max_model_len to {episode_tokens} or lower "
            "max_context_tokens")


def check_partition(part: Partition, rollout: RolloutConfig, trainers: Mapping[str, TrainerConfig]) -> None:
    """ValueError naming the field and the fix when ``part``'s settings cannot be used: set on
    a partition of another role, an unknown key, a bad value, an engine that spans more GPUs
    than the partition's workers have, a sim engine for real trainers or a real one for sim
    trainers (``trainers``; with none, as for ``astraflow partitions add``, the run's own engine
    type stands for them: the run's config matched it to its trainers)."""
    for section, role in (("rollout", "rollout"), ("trainer", "trainer")):
        if getattr(part, section) and part.role != role:
            raise ValueError(f"partitions[{part.name}].{section}: settings for {role} workers on a partition of "
                             f"role {part.role!r}; move them to a {role} partition or remove them")
    if part.role == "rollout":
        _check_lease_ahead(part, effective_rollout(rollout, part))
        engine = effective_rollout(rollout, part).engine
        tp, gpus = engine.tensor_parallel, part.gpus_per_node
        if tp > 1 and (gpus < tp or gpus % tp):
            raise ValueError(
                f"partitions[{part.name}]: rollout.engine.tensor_parallel {tp} spans {tp} GPUs per engine and the "
                f"partition gives a node {gpus}: set gpus_per_node to a multiple of {tp}, or lower tensor_parallel")
        field = (f"partitions[{part.name}].rollout.engine.type" if "type" in part.rollout.get("engine", {})
                 else "rollout.engine.type")
        for name, trainer in trainers.items():
            problem = sim_mismatch(field, engine.type, f"policies[{name}].trainer.backend", trainer.backend)
            if problem:
                raise ValueError(problem)
        if (engine.type == "sim") != (rollout.engine.type == "sim"):
            raise ValueError(
                f"{field} {engine.type!r}: the run's rollout.engine.type is {rollout.engine.type!r} and its trainers "
                "match it (sim engines serve only sim trainers, real engines only real ones): set "
                f"{field}: {rollout.engine.type}, or drop it")
        if part.scheduler == "slurm" and engine.type != "sim" and engine.device.startswith("cuda") and not gpus:
            raise ValueError(
                f"partitions[{part.name}]: rollout.engine.device {engine.device} needs a GPU and the partition's "
                "jobs request none: set gpus_per_node, or use device: auto or cpu")
    for name, trainer in trainers.items():
        mine = effective_trainer(trainer, part)
        if (part.role == "trainer" and part.scheduler == "slurm" and mine.backend != "sim"
                and mine.device.startswith("cuda") and not part.gpus_per_node):
            raise ValueError(
                f"partitions[{part.name}]: the trainer of {name} runs on device {mine.device}, which needs a GPU, "
                "and the partition's jobs request none: set gpus_per_node, or use device: "
                "auto or cpu")


def _check_lease_ahead(part: Partition, cfg: RolloutConfig) -> None:
    """``rollout.lease_ahead`` stocks tasks for the nodes of a worker that runs several
    (``RaaSNodeGroup``); a worker of one node leases from the data layer itself, so on such a
    partition the setting would do nothing."""
    if cfg.lease_ahead == 0 or cfg.nodes_per_worker > 1:
        return
    own = "lease_ahead" in part.rollout
    field = f"partitions[{part.name}].rollout.lease_ahead" if own else "rollout.lease_ahead"
    raise ValueError(
        f"{field} {cfg.lease_ahead}: a lease stock serves the nodes of a worker that runs several "
        f"(rollout.nodes_per_worker above 1, sim engines), and partition {part.name!r} runs one node per worker, "
        "which leases from the data layer itself: set nodes_per_worker above 1, or "
        + ("drop lease_ahead" if own else f"lease_ahead: 0 (for this partition alone: partitions[{part.name}]"
                                          ".rollout: {lease_ahead: 0})"))


def check_deltas(deltas: bool, rollout: RolloutConfig, partitions: list[Partition], policies: Any = ()) -> None:
    """``storage.deltas`` makes every trainer write a delta after each commit for the nodes one
    version behind; where every rollout partition loads full shards at every version
    (``full_resync_every: 1``, the run's or its own) no node would apply one. Nodes then serve each
    version rounded to bf16 (what the deltas rebuild): a trainer publishing fp32 would commit
    weights other than those its tokens were sampled with."""
    for pol in policies if deltas else ():
        if pol.trainer.publish_dtype == "fp32" and pol.trainer.backend != "sim":
            raise ValueError(
                f"policies[{pol.name}].trainer.publish_dtype: fp32 with storage.deltas: the nodes serve every "
                "version as bf16 (what the deltas rebuild), so the committed fp32 weights are not the ones its "
                "tokens were sampled with; set publish_dtype: bf16 (or auto), or storage.deltas: false")
    every = [effective_rollout(rollout, p).full_resync_every for p in partitions if p.role == "rollout"]
    if deltas and every and all(n == 1 for n in every):
        raise ValueError(
            "storage.deltas: true writes a delta after every commit for the nodes one version behind, and "
            "rollout.full_resync_every 1 has every node load full shards at every version, so none would ever "
            "apply one: set full_resync_every to 2 or more (default 10), or storage.deltas: false")


def changed(base: BaseModel, merged: BaseModel, prefix: str = "") -> dict[str, Any]:
    """``{dotted field: value}`` where ``merged`` differs from ``base`` (what a partition changes)."""
    out: dict[str, Any] = {}
    for name in type(base).model_fields:
        a, b = getattr(base, name), getattr(merged, name)
        if isinstance(a, BaseModel) and isinstance(b, BaseModel):
            out.update(changed(a, b, f"{prefix}{name}."))
        elif a != b:
            out[f"{prefix}{name}"] = b
    return out


def _merged(base: BaseModel, settings: Mapping[str, Any], where: str, allowed: tuple[str, ...] | None) -> Any:
    _check_keys(type(base), settings, where, allowed)
    bools = bool_problems(dict(settings), type(base), where)  # pydantic would read `true` as 1
    if bools:
        raise ValueError("; ".join(bools))
    data = _deep_merge(base.model_dump(), settings)
    try:
        return type(base).model_validate(data)
    except ValidationError as err:
        problems = "; ".join(f"{where}.{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
                             if e["loc"] else f"{where}: {e['msg'].removeprefix('Value error, ')}"
                             for e in err.errors())
        raise ValueError(problems) from None


def _check_keys(model: type[BaseModel], settings: Mapping[str, Any], where: str,
                allowed: tuple[str, ...] | None) -> None:
    """Every key names a field of ``model`` (of ``allowed``, when given), sections recursively."""
    if not isinstance(settings, Mapping):
        raise ValueError(f"{where}: write a mapping of {model.__name__} fields, got {settings!r}")
    names = allowed if allowed is not None else tuple(model.model_fields)
    for key, value in settings.items():
        if key not in names:
            raise ValueError(f"{where}.{key}: unknown key; a partition may set {', '.join(names)}")
        sub = model.model_fields[key].annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel) and isinstance(value, Mapping):
            _check_keys(sub, value, f"{where}.{key}", None)


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _deep_merge(out[key], value) if isinstance(out.get(key), dict) and isinstance(value, Mapping) \
            else value
    return out


def partition_capacity(rollout: RolloutConfig, part: Partition) -> dict[str, int] | None:
    """A rollout partition's lease capacity per node, the batch each engine decodes at most, and
    engines per node (``status --json`` and the dashboard show them); None for other roles."""
    if part.role != "rollout":
        return None
    cfg = effective_rollout(rollout, part)
    batch = cfg.engine.sim.profile().max_batch if cfg.engine.type == "sim" else cfg.engine.max_batch
    return {"node_capacity": cfg.node_capacity(part.gpus_per_node), "engine_max_batch": batch,
            "engines_per_node": cfg.engine.engines_per_node(part.gpus_per_node)}


def _capacity_line(cfg: RolloutConfig, gpus: int) -> str:
    """A node's lease capacity and where it comes from, with the batch its engines decode."""
    cap = cfg.node_capacity(gpus)
    if cfg.engine.type == "sim":
        p = cfg.engine.sim.profile()
        batch = f"sim {cfg.engine.sim.hardware} max_batch {p.max_batch} x {cfg.engine.sim_engines(gpus)} engine(s)"
    else:
        batch = f"engine max_batch {cfg.engine.max_batch} x {cfg.engine.engines_per_node(gpus)} engine(s)"
    how = "rollout.capacity" if cfg.capacity is not None else \
        ("derived from the hardware" if cfg.engine.type == "sim" else "twice the engines' batch")
    return f"{cap} episodes per node ({how}; {batch})"


def plan_lines(partitions: list[Partition], rollout: RolloutConfig, trainers: Mapping[str, TrainerConfig]) -> list[str]:
    """What each partition's workers run with, one line each (``astraflow check`` prints them):
    engines per policy on a RaaS node (as on a node that sees its GPUs) and the settings the
    partition changes."""
    lines = []
    for part in partitions:
        what = f"partition {part.name} ({part.role}, {part.nodes} node(s), {part.gpus_per_node} GPU(s) each)"
        if part.role == "rollout":
            cfg = effective_rollout(rollout, part)
            eng = cfg.engine
            on_gpus = part.gpus_per_node > 0 and eng.device in ("auto", "cuda")
            n = cfg.engine.engines_per_node(part.gpus_per_node)
            where = f"{eng.tensor_parallel} GPU(s) each" if on_gpus else f"on {eng.device}"
            what += f": {n} engine(s) per policy, {where}, {max(1, eng.threads // n)} thread(s) each"
            diff = changed(rollout, cfg, "rollout.")
        else:  # a trainer partition's fields replace every policy's
            for trainer in trainers.values():
                effective_trainer(trainer, part)  # validated
            diff = {f"trainer.{k}": v for k, v in part.trainer.items()}
        if diff:
            what += "; " + ", ".join(f"{k}={v}" for k, v in diff.items())
        if part.role == "rollout":
            what += f"; capacity {_capacity_line(cfg, part.gpus_per_node)}"
            if cfg.engine.type == "sim" and sim_hardware(part) is not None:
                what += f" (sim {cfg.engine.sim.hardware}: the partition's hardware label)"
        lines.append(what)
    return lines
