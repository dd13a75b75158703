"""Pools of a capacity plan and the simulated run that stands for a user's config on them.

A pool is ``KIND=GPUS``: ``GPUS`` engines of hardware ``KIND`` (a preset of ``sim_config``, or
``local``: this machine's engine as a calibration measured it). It becomes one rollout partition
of RaaS nodes with ``gpus_per_node`` sim engines each (or one node of fewer), all of a worker's
nodes on one event loop (``rollout.nodes_per_worker``; two partitions where the nodes split
unevenly over the workers), so the simulated GPUs are exactly the pool's. The rest of the
config — batch size, group size, staleness bound, admission, lease and weight-poll settings — is
the user's, so the simulated control plane makes the decisions the real one would; only the
model work is replaced by its time.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from astraflow.config import RunConfig
from astraflow.rollout.sim_config import PRESETS, HardwareProfile

#: the pool kind that stands for this machine's own engine (``--calibrate`` measures it)
LOCAL = "local"
#: sim nodes per rollout worker process at most (more workers above it)
NODES_PER_PROCESS = 50
#: the most sim nodes a pool may have (the scale the control plane was measured at on one machine)
MAX_NODES = 1000
#: bf16 dense peak FLOP/s of one GPU of a trainer (vendors' data sheets), for a derived step time
TRAINER_PEAK_FLOPS = {"h100": 989e12, "a100": 312e12}
#: fraction of the peak a training step reaches (model FLOPs utilisation): an assumption
TRAINER_MFU = 0.4

_POOL = re.compile(r"^([A-Za-z][A-Za-z0-9_]*)=(\d+)$")


class PlanError(ValueError):
    """Input ``astraflow plan`` cannot use; the message names the fix."""


@dataclass(frozen=True)
class Pool:
    """``gpus`` engines of hardware ``kind``, as RaaS nodes of ``gpus_per_node`` engines each."""

    kind: str
    gpus: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        # the label is what is simulated: one node of up to gpus_per_node engines, or whole nodes
        if self.gpus < 1 or self.gpus_per_node < 1 or (self.gpus > self.gpus_per_node
                                                       and self.gpus % self.gpus_per_node):
            raise ValueError(f"pool {self.label()}: not one node nor whole nodes of {self.gpus_per_node} GPUs")

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def engines_per_node(self) -> int:
        return min(self.gpus, self.gpus_per_node)

    def scaled(self, factor: float) -> "Pool":
        """This pool with about ``factor`` times the GPUs, in a size ``--pool`` accepts (and the
        simulated run has): up to one node's GPUs, a single node of that many (at least one GPU);
        above it, the nearest whole number of full nodes."""
        target = self.gpus * factor
        if target <= self.gpus_per_node:
            return Pool(self.kind, max(1, math.floor(target + 0.5)), self.gpus_per_node)
        nodes = max(1, math.floor(target / self.gpus_per_node + 0.5))
        return Pool(self.kind, nodes * self.gpus_per_node, self.gpus_per_node)

    def label(self) -> str:
        return f"{self.kind}={self.gpus}"


def simulated_factor(pools: list[Pool], factor: float) -> float:
    """The factor the pools scaled by ``factor`` actually have (their GPUs over the planned GPUs):
    sizes are whole nodes, so it is what the search simulates and reports, not ``factor``."""
    return sum(p.scaled(factor).gpus for p in pools) / sum(p.gpus for p in pools)


def parse_pool(spec: str, gpus_per_node: int, local: HardwareProfile | None) -> Pool:
    """``KIND=GPUS`` as a `Pool`; PlanError naming the fix for bad syntax or an unknown kind."""
    m = _POOL.fullmatch(spec.strip())
    if not m and re.fullmatch(r"\s*\w+\s*=\s*-\s*\d+\s*", spec):  # a negative count: the size is what is wrong
        raise PlanError(f"--pool {spec!r}: a pool needs at least 1 GPU")
    if not m:
        raise PlanError(f"--pool {spec!r}: write KIND=GPUS, e.g. --pool h100=64 (kinds: {kinds()})")
    kind, gpus = m.group(1).lower(), int(m.group(2))
    if kind not in PRESETS and kind != LOCAL:
        raise PlanError(f"--pool {spec!r}: unknown hardware kind {kind!r}; use one of {kinds()}")
    if kind == LOCAL and local is None:
        raise PlanError(f"--pool {spec!r}: the local pool is this machine's engine as measured; add --calibrate "
                        "(measures it now) or --calibration FILE (a saved measurement)")
    if gpus < 1:
        raise PlanError(f"--pool {spec!r}: a pool needs at least 1 GPU")
    if kind != LOCAL and gpus > gpus_per_node and gpus % gpus_per_node:  # a partition's nodes are alike
        # suggest the whole-node sizes either side, only those within the node limit below
        nodes = [n for n in (gpus // gpus_per_node, math.ceil(gpus / gpus_per_node)) if n <= MAX_NODES]
        fix = "use " + " or ".join(f"{kind}={n * gpus_per_node}" for n in nodes)
        if len(nodes) < 2:
            fix = (fix if nodes else f"use at most {kind}={MAX_NODES * gpus_per_node}") + \
                f" (a pool is at most {MAX_NODES} nodes)"
        raise PlanError(f"--pool {spec!r}: {gpus} GPUs are not whole nodes of --gpus-per-node {gpus_per_node}; "
                        f"{fix}, or another --gpus-per-node")
    pool = Pool(kind, gpus, 1 if kind == LOCAL else gpus_per_node)
    if pool.nodes > MAX_NODES:
        raise PlanError(f"--pool {spec!r}: {pool.nodes} nodes of {pool.gpus_per_node} GPU(s); a plan simulates at most "
                        f"{MAX_NODES} nodes a pool (this machine runs them all): plan a smaller pool, or more GPUs a "
                        "node (--gpus-per-node)")
    return pool


def kinds() -> str:
    return ", ".join([*PRESETS, LOCAL])


def derived_step_seconds(params: float, tokens: float, trainer_gpus: int, kind: str) -> float:
    """A trainer step of ``tokens`` tokens on a model of ``params`` parameters: ``6 * params *
    tokens`` FLOPs (forward and backward) at ``TRAINER_MFU`` of ``trainer_gpus`` GPUs' peak."""
    if kind not in TRAINER_PEAK_FLOPS:
        raise PlanError(f"--trainer {kind}={trainer_gpus}: unknown trainer GPU kind; use one of "
                        f"{', '.join(TRAINER_PEAK_FLOPS)}, or give --step-seconds")
    return 6.0 * params * tokens / (trainer_gpus * TRAINER_PEAK_FLOPS[kind] * TRAINER_MFU)


#: the config's ``rollout.engine.sim`` settings a plan uses (the rest describe one engine's
#: hardware, which each pool's kind or the calibration sets instead)
SIM_SETTINGS_USED = ("hardware", "time_scale", "length_mean", "length_sigma")


def ignored_sim_settings(cfg: RunConfig) -> list[str]:
    """The config's (or ``--set``'s) ``rollout.engine.sim`` settings the simulated pools do not
    carry: a named pool's engines follow its preset, a ``local`` pool's the calibration."""
    if cfg.rollout.engine.type != "sim":
        return []
    return sorted(f"rollout.engine.sim.{k}" for k in cfg.rollout.engine.sim.model_fields_set
                  if k not in SIM_SETTINGS_USED)


@dataclass(frozen=True)
class SimShape:
    """What the simulated run takes from measurements or assumptions rather than the config."""

    step_seconds: float
    """Simulated seconds of one trainer step."""
    prompt_tokens: int
    response_mean: float
    """Mean response length in tokens (lognormal, capped at ``max_new_tokens``)."""
    response_sigma: float
    time_scale: float
    """Simulated seconds per real second (engines and trainer alike)."""
    steps: int
    local: HardwareProfile | None = None
    """The local pool's measured engine, when there is one."""


def profile(pool: Pool, shape: SimShape) -> HardwareProfile:
    """The engine a pool's nodes simulate: its kind's preset, or the calibration for ``local``."""
    if pool.kind == LOCAL:
        assert shape.local is not None
        return shape.local
    return PRESETS[pool.kind]


def engine_seconds(pools: list[Pool], shape: SimShape) -> float:
    """Simulated seconds from a new weight version to a sample of it on the slowest pool's engine
    (its load, time to first token, prefill, a mean response at the single-request rate): the
    engines' own timeline, which runs in real time divided by the time scale as the trainer's does."""
    return max((p.load_seconds + p.ttft_s + shape.prompt_tokens / p.prefill_tokens_per_s
                + shape.response_mean / p.single_tokens_per_s for p in (profile(q, shape) for q in pools)),
               default=0.0)


def sim_config(cfg: RunConfig, pools: list[Pool], shape: SimShape, name: str = "plan") -> dict[str, Any]:
    """The simulated run (as config data) standing for ``cfg`` on ``pools``: sim engines of each
    pool's hardware, sim trainers taking ``shape.step_seconds`` a step, the sim workload with
    the config's group size and sampling, no held-out evaluation, one rollout partition per
    pool. A named-hardware pool's nodes lease what their hardware takes (``rollout.capacity``
    derived from it); the local pool keeps the config's capacity, the one the real run uses.
    The config's autoscaler is left out: the pools keep the sizes being planned."""
    data = cfg.model_dump(mode="json")
    scale = shape.time_scale
    step_real = shape.step_seconds / scale
    # the deadline: many times what a trainer that never waits needs, plus a few engine timelines
    # (a weight load and a response) a step, which bound a run however fast its trainer is
    engine_real = engine_seconds(pools, shape) / scale
    data["run"].update(name=name, max_steps=shape.steps,
                       timeout_s=max(600.0, 20 * shape.steps * step_real + 3 * shape.steps * engine_real + 300))
    for pol in data["policies"]:
        pol.update(model="sim", init=None)
        # one step time, the one reported: no per-token time or schedule on top of it
        pol["trainer"].update(backend="sim", sim_step_seconds=step_real, sim_seconds_per_token=0.0,
                              sim_step_schedule={}, tensor_parallel=1, data_parallel=1)
    wl = data["workload"]
    data["workload"] = {
        "name": "sim", "workflow": "sim", "group_size": wl["group_size"], "sampling": wl["sampling"],
        "seed": wl.get("seed", 0), "eval": {**wl["eval"], "every": 0},
        "params": {"num_train": 100_000, "num_test": 8, "prompt_tokens": shape.prompt_tokens},
    }
    rollout = data["rollout"]
    rollout["engine"].update(type="sim", replicas=None, tensor_parallel=1, sim={
        "time_scale": scale, "length_mean": shape.response_mean, "length_sigma": shape.response_sigma})
    # a node's own intervals are latencies of the real system: in simulated time they keep their
    # length only if they shrink with the scale (a 0.5 s flush would otherwise hold every
    # trajectory for 0.5 x time_scale simulated seconds)
    for key in ("flush_seconds", "weight_poll_seconds"):
        rollout[key] = max(rollout[key] / scale, 0.005)
    rollout["capacity"] = None
    rollout["nodes_per_worker"] = 1
    data["autoscale"] = None  # the pools are the sizes to plan: nothing resizes them mid-run
    data["cluster"]["dashboard_port"] = 0
    data["cluster"].pop("scheduler_address", None)
    parts = [{"name": "data", "scheduler": "local", "role": "data", "nodes": 1},
             {"name": "trainer", "scheduler": "local", "role": "trainer", "nodes": 1}]
    for pool in pools:
        sim = {"hardware": "h100"} if pool.kind == LOCAL else {"hardware": pool.kind}
        if pool.kind == LOCAL:
            assert shape.local is not None
            sim.update(shape.local.model_dump())
        # a partition's workers all hold as many nodes: an uneven split is two partitions of the
        # pool (the second named ``pool_KIND.rest``, counted as the same pool)
        for suffix, workers, per_worker in worker_split(pool.nodes):
            settings: dict[str, Any] = {"nodes_per_worker": per_worker,
                                        "engine": {"replicas": pool.engines_per_node, "sim": dict(sim)}}
            if pool.kind == LOCAL:  # what the real run's node leases, with this pool's engines
                engine = cfg.rollout.engine.model_copy(update={"replicas": pool.engines_per_node})
                settings["capacity"] = (cfg.rollout.capacity if engine.type == "sim"  # else the profile's own
                                        else cfg.rollout.model_copy(update={"engine": engine}).node_capacity(0))
            parts.append({"name": f"pool_{pool.kind}{suffix}", "scheduler": "local", "role": "rollout",
                          "nodes": workers, "hardware": pool.kind, "rollout": settings})
    data["partitions"] = parts
    return data


def worker_split(nodes: int) -> list[tuple[str, int, int]]:
    """``nodes`` sim nodes as ``(partition suffix, workers, nodes per worker)``: the fewest
    workers of at most ``NODES_PER_PROCESS`` nodes, as even as can be, adding up to ``nodes``."""
    workers = math.ceil(nodes / NODES_PER_PROCESS)
    base, extra = divmod(nodes, workers)
    if not extra:
        return [("", workers, base)]
    return [("", extra, base + 1), (".rest", workers - extra, base)]
