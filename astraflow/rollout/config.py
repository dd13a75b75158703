"""Config of a RaaS node and its inference engine."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from astraflow.configbase import Strict
from astraflow.probe import PROBE_LEN
from astraflow.rollout.sim_config import SimEngineConfig


#: the engine types ``rollout.engine.type`` can name (``engines.make_engine`` builds them)
EngineType = Literal["hf", "vllm", "sim"]


class VLLMConfig(Strict):
    """``rollout.engine.vllm``: the vLLM engine's own settings (``rollout/vllm_engine.py``)."""

    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    """Fraction of each GPU's memory the node's vLLM engines on it take together (weights,
    activations, KV cache): engines that share a GPU (several policies, more replicas than
    GPUs) split it evenly."""
    max_model_len: int | None = Field(default=None, gt=PROBE_LEN)
    """Longest prompt + completion in tokens; ``None``: the model's ``max_position_embeddings``.
    More than the probe sequence every weight update is checked with (``astraflow.probe``)."""
    weight_update: Literal["auto", "in_place", "reload", "recreate"] = "auto"
    """How a new weight version reaches the engine. ``in_place``: vLLM's weight-transfer
    protocol (pause, start, update, finish, resume) with the weights read from the weight store
    inside vLLM's workers; ``reload``: vLLM's older ``reload_weights`` call (it serves wrong
    log-probs on the CPU build, which the check catches); ``recreate``: a new engine on the new
    weights (an engine start per version); ``auto``: ``in_place`` where the installed vLLM has
    the protocol (the engine needs vLLM 0.32 or newer, which do), else ``recreate``. Every
    update is checked against the version's probe log-probs, and one that fails the check is
    redone by re-creating the engine (with a warning naming the vLLM build), as is every later
    update of that engine."""
    probe_tolerance: float = Field(default=0.05, gt=0)
    """Largest mean absolute difference (nats) between the engine's log-probs of the version's
    probe sequence and the trainer's that counts as the right weights. Versions published in
    bf16 are probed by the trainer with the bf16 weights, so the difference is rounding noise
    far below this; a wrong update is off by whole nats."""
    cpu_kvcache_gib: int = Field(default=2, ge=1)
    """CPU build only: KV cache size in whole GiB (``VLLM_CPU_KVCACHE_SPACE``, which vLLM reads
    as an integer)."""
    cpu_bind: Literal["cores", "none"] = "cores"
    """CPU build only: where vLLM's OpenMP threads (``rollout.engine.threads`` of them) run.
    ``cores``: each bound to one of the first CPUs the worker may use (a CPU list of its own for each
    tensor-parallel worker of the engine), as vLLM recommends for a
    machine the engine has to itself; ``none``: not bound, the operating system places them and
    moves them off a CPU that another process wants (a machine the node shares with the data
    layer, the trainer or other programs, where a bound thread cannot escape a busy core).
    ``VLLM_CPU_OMP_THREADS_BIND``, when set, overrides either."""
    enforce_eager: bool = True
    """No CUDA graphs / compilation: faster start and re-creation, slower decoding on GPUs."""


class EngineConfig(Strict):
    type: EngineType = "hf"
    """Inference engine: ``hf`` (transformers; CPU, or one GPU per engine), ``vllm`` (vLLM's
    V1 engine with continuous batching; needs the ``vllm`` extra, see ``vllm:``) or ``sim`` (no
    model: it takes the time a serving engine on ``sim.hardware`` would, ``docs/sim.md``)."""
    sim: SimEngineConfig = SimEngineConfig()
    """The simulated engine's hardware profile and response lengths (``type: sim`` only)."""
    max_batch: int = Field(default=64, ge=1)
    """Most requests decoded together in one batch."""
    swap_min_remaining: int = Field(default=16, ge=0)
    """A newer weight version that arrives while a batch decodes is applied between two
    decoding steps (partial rollout: the batch is re-encoded with the new weights) only while at
    least this many steps are left; nearer the end the batch finishes first. Re-encoding costs
    a prefill of every row: for short answers it costs more than the fresher tokens are worth.
    0: always at the next step."""
    threads: int = Field(default=1, ge=1)
    """torch intra-op threads of the node's engines, split evenly between its replicas (each
    gets at least one); ``vllm`` on the CPU build: its OpenMP threads (bound or not:
    ``vllm.cpu_bind``)."""
    replicas: int | None = Field(default=None, ge=1)
    """Engines per policy on one node, each with its own share of the node (``EnginePool``
    spreads the node's requests over them, every replica takes every weight version). None:
    one per ``tensor_parallel`` GPUs of the worker (its partition's ``gpus_per_node``; every
    GPU used), 1 on a CPU worker. Set it on a CPU worker with many cores to run several
    engines side by side (``threads`` is split between them); replicas beyond the GPUs share
    them in turn."""
    tensor_parallel: int = Field(default=1, ge=1)
    """GPUs each engine spans by tensor parallelism (one engine over several GPUs instead of
    one engine per GPU). Only an engine type that shards a model can; ``hf`` runs each engine
    on one device, so it takes 1; ``vllm`` shards each engine over them."""
    process: bool = True
    """Run the engine in a process of its own, next to the node's Dask worker. The node's
    Python work (Dask comms, trajectory writes) then no longer competes with decoding for the
    interpreter lock (``benchmarks/rollout_overhead.py``). ``false``: in the worker process.
    ``vllm`` always runs its engine core in processes of its own and ignores this."""
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """Where the engines run: ``auto`` or ``cuda`` (the worker's GPUs, one engine per GPU; ``auto``
    falls back to the CPU where there is none), ``cpu``, or ``cuda:N`` (that GPU, shared by the
    node's engines). ``vllm`` runs on the GPUs its replica is given (``cuda:N``: that GPU), or
    on the CPU with vLLM's CPU build (vLLM takes its platform from the build installed, not
    from this setting)."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """The engine's weights and forward passes. ``bf16`` decodes faster where the
    hardware has bf16 (GPUs; CPUs with AVX512-BF16 or AMX; elsewhere it is slower than fp32);
    its log-probs then differ slightly from the trainer's fp32 ones, which the loss's clipped
    importance ratio absorbs. Sampling and log-probs are computed from fp32 logits either way."""
    vllm: VLLMConfig = VLLMConfig()
    """Settings only the ``vllm`` engine reads."""

    def sim_engines(self, gpus: int) -> int:
        """Sim engines on a node whose partition gives it ``gpus`` GPUs: ``replicas``, else one
        per ``tensor_parallel`` GPUs, at least one."""
        return self.replicas or max(gpus // self.tensor_parallel, 1)

    def engines_per_node(self, gpus: int) -> int:
        """Engines per policy on a node whose partition gives it ``gpus`` GPUs (as on a node that
        sees them): ``replicas``, else one per ``tensor_parallel`` GPUs where it runs on GPUs, one."""
        if self.type == "sim":
            return self.sim_engines(gpus)
        on_gpus = gpus > 0 and self.device in ("auto", "cuda")
        return self.replicas or (max(gpus // self.tensor_parallel, 1) if on_gpus else 1)

    @model_validator(mode="after")
    def _parallelism(self) -> "EngineConfig":
        if self.type == "hf" and self.tensor_parallel > 1:
            raise ValueError(
                f"rollout.engine.tensor_parallel {self.tensor_parallel}: the hf engine runs each engine on one "
                "device and cannot shard a model over GPUs; set tensor_parallel: 1 (a node then runs one engine "
                "per GPU, or rollout.engine.replicas of them), or use an engine type with tensor parallelism")
        if self.tensor_parallel > 1 and self.device.startswith("cuda:"):
            raise ValueError(
                f"rollout.engine.device {self.device} names one GPU and tensor_parallel {self.tensor_parallel} "
                f"spans {self.tensor_parallel}: set device: auto (or cuda) to shard each engine over the worker's "
                "GPUs, or tensor_parallel: 1")
        return self


class RolloutConfig(Strict):
    """A RaaS node (owned by ``astraflow.rollout``)."""

    engine: EngineConfig = EngineConfig()
    """The inference engine of each policy on the node."""
    capacity: int | None = Field(default=None, ge=1)
    """Episodes in flight on one node. Above ``engine.max_batch`` (2x is a good start) the next
    batch already waits in the engine while one decodes, so the engine never idles for a lease
    round trip. None: twice what the node's engines decode at once (``max_batch`` times the
    engines per policy; for sim engines the batch at which the hardware peaks, ``node_capacity``);
    set it per pool with ``partitions[].rollout.capacity``."""
    write_batch: int = Field(default=64, ge=1)
    """Trajectories buffered before a segment write (also flushed every ``flush_seconds``)."""
    segment_max_entries: int = Field(default=50_000, ge=1)
    """Stored sequences (one per trajectory in a single-policy workflow) one segment of the
    store holds before the node moves to a new one: a reader opening a segment parses its whole
    commit log, so this bounds what a resume, a restarted trainer or the episode viewer pays per
    segment; a full segment is never written again."""
    flush_seconds: float = Field(default=0.5, gt=0)
    """Longest time a finished trajectory waits in the node before it is written."""
    lease_wait_seconds: float = Field(default=0.5, ge=0, le=5)
    """How long one lease call may wait in the data layer for tasks when it has none (a long
    poll: tasks reach the node the moment they exist, without a call every few ms)."""
    lease_ahead: int = Field(default=0, ge=0)
    """With several nodes per worker (``nodes_per_worker``): the most tasks the worker keeps
    leased ahead for its nodes (its lease stock, ``rollout/lease_stock.py``), so that a node
    with a free slot gets its answer at once instead of after a data-layer round trip, which a
    data layer serving a thousand nodes gives in tens of milliseconds at the tail. The stock
    follows the nodes' rate (what they ask for in about two round trips) up to this. 0 (the
    default): every lease goes to the data layer, as a real node's does, which is what
    ``astraflow plan`` should predict from; with the stock, tasks reach nodes one hop later
    and runs bound by admission flow somewhat less (``docs/sim.md``). Refused on a rollout
    partition whose workers run one node each (it leases from the data layer itself)."""
    weight_poll_seconds: float = Field(default=0.1, gt=0)
    """How often the node checks the weight store for a newer version (a listing of the policy's
    version directory). A node whose weights fall more than ``dataflow.max_staleness`` versions
    behind gets no new work until it loads newer ones, so poll well within a trainer step."""
    full_resync_every: int = Field(default=10, ge=1)
    """With ``storage.deltas``: load full shards instead of a delta every N versions (1 on every
    rollout partition is refused: no node would apply a delta)."""
    reward_timeout_s: float = Field(default=30.0, gt=0)
    """Deadline of one reward call. Rewards run off the node's event loop, so a slow one stalls
    neither heartbeats nor other episodes; one past its deadline fails its episode (retried up to
    ``dataflow.max_attempts``). A reward that may never return belongs in the sandbox: a thread
    cannot be killed, so it keeps its pool thread."""
    episode_timeout_s: float = Field(default=600.0, gt=0)
    """Deadline of one whole episode (waiting for its weight version, every turn, engine call,
    tool and reward). An episode past it is cancelled and its task failed (retried up to
    ``dataflow.max_attempts``), so an engine call that never returns cannot hold a lease for
    ever through the node's heartbeats. Raise it for workflows with very long episodes."""
    nodes_per_worker: int = Field(default=1, ge=1)
    """RaaS nodes on each rollout worker, all on one shared asyncio loop (``rollout/node_group.py``).
    Above 1 only with ``engine.type: sim``: sim nodes do no work of their own, so a hundred of
    them fit in one process (``docs/sim.md``)."""
    engine_restarts: int = Field(default=3, ge=0)
    """How many times a node restarts an engine process that died (its in-flight episodes
    fail and are requeued; the new process loads the newest committed weights before the node
    leases again). After that the node stops leasing and reports the error."""

    def node_capacity(self, gpus: int) -> int:
        """Episodes a node on a worker with ``gpus`` GPUs leases at once: ``capacity`` when set.
        Unset, a sim node takes twice its engines' useful batch, the batch at which decoding
        reaches the hardware's peak rate (``peak / single`` tokens/s, at most ``max_batch``):
        past it requests only share the same rate, and the second half waits queued so that
        no engine idles for a lease round trip. Faster hardware, with a higher knee, so leases
        more at once. A real engine's rates are not known before it runs: twice the batch its
        engines decode at most (``max_batch``), for the same reason."""
        if self.capacity is not None:
            return self.capacity
        if self.engine.type != "sim":
            return 2 * self.engine.max_batch * self.engine.engines_per_node(gpus)
        p = self.engine.sim.profile()
        knee = min(p.max_batch, math.ceil(p.peak_tokens_per_s / p.single_tokens_per_s))
        return 2 * knee * self.engine.sim_engines(gpus)

    @model_validator(mode="after")
    def _shared_nodes(self) -> "RolloutConfig":
        if self.nodes_per_worker > 1 and self.engine.type != "sim":
            raise ValueError(
                f"rollout.nodes_per_worker {self.nodes_per_worker}: several nodes share one process and one "
                "event loop, which only sim engines (no model, no decoding work) allow; set "
                "rollout.engine.type: sim or nodes_per_worker: 1")
        return self
