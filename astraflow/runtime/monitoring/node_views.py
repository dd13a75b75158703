"""The status view's partitions and their workers (`view.StatusView` holds them), and the base
every view model shares: a module of their own so the view's builder stays readable.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 2
"""Version of the status and metrics views; bumped when a field changes meaning."""


class _View(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NodeView(_View):
    """One worker of the run (a RaaS node, the data layer or a trainer)."""

    name: str = Field(description="Dask worker name, e.g. rollout-rollout-local-cpu-0")
    partition: str = Field(description="partition the worker's job belongs to")
    role: str = Field(description="rollout | data | trainer")
    hardware: str = Field(description="the partition's hardware label (cpu, a100, ...)")
    region: str = Field(description="the partition's region label")
    job_id: str = Field(description="local pid-based id or Slurm job id")
    state: str = Field(description="job state from the scheduler (RUNNING, PENDING, ...); "
                                   "DRAINING while it finishes its leases; GONE once it left; "
                                   "ENDED when the run finished; UNKNOWN when it stopped without a summary "
                                   "(its last status is all there is)")
    versions: dict[str, int] = Field(description="weight version served per policy (RaaS nodes; empty otherwise)")
    leased_now: int = Field(description="tasks the node holds right now (in flight)")
    leased_total: int = Field(description="tasks leased to the node since it joined")
    completed_total: int = Field(description="tasks the node completed")
    episodes: int = Field(description="episodes the node generated")
    tokens: int = Field(description="tokens the node's policies sampled (prompts and tool output not counted)")
    episodes_per_s: float = Field(description="episodes per second over the node's lifetime")
    generated_tokens_per_s: float = Field(description="sampled tokens per second over the node's lifetime")
    idle_fraction: float | None = Field(description="share of the node's lifetime with nothing to generate "
                                                    "(RaaS nodes; None otherwise)")
    last_seen_s: float | None = Field(description="seconds since its last heartbeat; None: never (not a RaaS node)")
    phase: str | None = Field(default=None, description="where the worker is in its life: submitted (its job waits "
                              "or starts), placing, starting (a RaaS node loading its weights), serving, "
                              "draining, gone; None when the status does not say")
    host: str | None = Field(default=None, description="the node its job runs on (Slurm's node list, localhost); "
                                                       "None while it waits, once it is gone, or when unknown")
    reason: str | None = Field(default=None, description="why its job waits in the queue (Slurm's reason: "
                                                         "Resources, Priority, ReqNodeNotAvail...); None otherwise")


class BoundsView(_View):
    """A partition's autoscale bounds (``partitions[].autoscale``)."""

    min_nodes: int
    max_nodes: int
    cooldown_s: float


class CapacityView(_View):
    """What a rollout partition's nodes take on: faster hardware leases more at once."""

    node_capacity: int = Field(description="episodes a node leases at once (rollout.capacity, or derived)")
    engine_max_batch: int = Field(description="requests an engine decodes together at most")
    engines_per_node: int = Field(description="engines per policy on a node")


class PartitionView(_View):
    """A partition as configured (or added with ``astraflow partitions add``)."""

    name: str
    scheduler: str = Field(description="local | slurm")
    role: str = Field(description="rollout | data | trainer")
    hardware: str
    region: str
    desired: int = Field(description="nodes the partition should have (0 once its removal was asked for)")
    live: int = Field(description="its workers that are not gone, queued ones included (0 once the run finished)")
    serving: int = Field(default=0, description="its workers that serve: joined, their actors placed and started "
                                                "(a RaaS node has loaded its weights); 0 once the run finished")
    nodes: list[NodeView] = Field(description="its workers, by name")
    state: str = Field(default="?", description="active | removing | removed | failed (not refilled); ? when unknown")
    failures: int = Field(default=0, description="its workers that failed (lost before serving or soon after)")
    refill_in_s: float | None = Field(default=None, description="seconds until it is refilled again (backoff after "
                                                              "a failure); None when not waiting")
    error: str | None = Field(default=None, description="why it failed; None while healthy")
    trajectories_per_s: float = Field(default=0.0, description="tasks its nodes completed per second over the "
                                                               "last ~10 s; 0 once the run finished")
    tokens_per_s: float = Field(default=0.0, description="tokens its nodes sampled per second over the last ~10 s; "
                                                         "0 once the run finished")
    consumed: int = Field(default=0, description="sequences its nodes generated that trainers consumed")
    staleness_mean: float | None = Field(default=None, description="mean versions behind the trainer of those "
                                                                   "sequences when consumed; None before any")
    staleness_max: int | None = Field(default=None, description="their largest staleness; None before any")
    versions: dict[str, list[int]] = Field(default_factory=dict, description="per policy: the weight versions "
                                                                            "its live nodes serve now")
    autoscale: BoundsView | None = Field(default=None, description="its autoscale bounds; None: not autoscaled")
    capacity: CapacityView | None = Field(default=None, description="a rollout partition's lease capacity and "
                                                                    "engine batch; None for other roles")
