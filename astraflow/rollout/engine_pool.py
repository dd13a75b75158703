"""Several engines of one policy on one RaaS node: one per GPU, or several on a many-core CPU.

``plan_replicas`` decides how many engines a node runs and what each gets (its GPUs, torch
threads, seed); ``EnginePool`` puts them behind the ``InferenceEngine`` protocol, so workflows
and the weight watcher see one engine.

Routing: a request goes to the live replica with the fewest requests in flight (then the
fewest tokens asked for), among those holding the newest version any live replica holds. A
replica that was restarted, or that missed a version, so gets no new request until the
node's weight watcher has caught it up.

Asynchronous overlap "weight swap vs routing": every replica takes every version
(``load_version``/``load_weights`` go to each replica below it), and each tags the tokens it
generates with its own version, so per-token versions stay exact whichever replica serves a
request. The pool's ``version`` is the lowest a live replica holds: an episode that needs
version v starts only once every live replica has it.

Failure: a replica that dies fails only the requests it was serving; the others keep serving.
The node restarts dead replicas one by one (``replicas_of``), each start counted against
``rollout.engine_restarts``.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping

from astraflow.rollout.config import EngineConfig
from astraflow.rollout.engine import Generation, InferenceEngine, SamplingParams, confirmed_version
from astraflow.rollout.process_engine import STAT_KEYS, EngineProcessError

log = logging.getLogger("astraflow.rollout")


@dataclass(frozen=True)
class ReplicaPlan:
    """What one engine of a node is started with."""

    index: int
    #: its GPUs, as indices among the node's (empty: none of its own)
    gpus: tuple[int, ...]
    #: ``CUDA_VISIBLE_DEVICES`` of an engine in a process of its own (its GPUs); None: the node's
    visible_devices: str | None
    #: ``rollout.engine.device``, as an engine in a process of its own sees it
    device: str
    #: torch intra-op threads
    threads: int
    seed: int

    @property
    def device_in_node(self) -> str:
        """The device of an engine in the node's process, which sees all the node's GPUs."""
        return f"cuda:{self.gpus[0]}" if self.gpus else self.device


def plan_replicas(cfg: EngineConfig, gpus: int, cuda_seen: int, node_visible: str | None,
                  seed: int = 0) -> list[ReplicaPlan]:
    """The engines of one policy on a node whose partition gives it ``gpus`` GPUs, of which
    torch sees ``cuda_seen`` (``node_visible``: the node's ``CUDA_VISIBLE_DEVICES``).

    With ``device: auto`` or ``cuda`` and GPUs seen, engine i takes ``tensor_parallel`` GPUs of
    its own (in turn, when ``replicas`` asks for more engines than the GPUs hold); one
    engine per ``tensor_parallel`` GPUs by default. Otherwise (a CPU worker, or an explicit
    ``cuda:N``) the engines share the device, one by default. ``threads`` is split evenly."""
    ids = [d.strip() for d in node_visible.split(",") if d.strip()] if node_visible else \
        [str(i) for i in range(cuda_seen)]
    on_gpus = cfg.device in ("auto", "cuda")
    usable = min(gpus, cuda_seen, len(ids)) if on_gpus else 0
    if on_gpus and 0 < cuda_seen < gpus:
        log.warning("the partition gives this node %d GPU(s) but torch sees %d here: engines use %d",
                    gpus, cuda_seen, usable)
    tp = cfg.tensor_parallel
    n = cfg.replicas or (max(usable // tp, 1) if usable else 1)
    threads = max(1, cfg.threads // n)
    plans = []
    for i in range(n):
        own = tuple(sorted({(i * tp + k) % usable for k in range(tp)})) if usable else ()
        plans.append(ReplicaPlan(index=i, gpus=own, visible_devices=",".join(ids[j] for j in own) if own else None,
                                 device=cfg.device, threads=threads, seed=seed + i))
    return plans


class EnginePool:
    """``InferenceEngine`` over several replicas of one policy's engine (see the module
    docstring). ``replicas`` are started engines of one type; the pool owns them from here."""

    def __init__(self, replicas: list[InferenceEngine]):
        assert replicas, "EnginePool needs at least one replica"
        self.replicas: tuple[InferenceEngine, ...] = tuple(replicas)
        self.tokenizer: Any = self.replicas[0].tokenizer
        #: requests and tokens (prompt + max_new_tokens) in flight per replica
        self._requests = [0] * len(self.replicas)
        self._tokens = [0] * len(self.replicas)
        #: requests routed to each replica so far
        self.routed = [0] * len(self.replicas)

    # -- routing ---------------------------------------------------------------------------
    def _live(self) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if not r.dead]

    def _pick(self) -> int:
        live = self._live()
        if not live:
            raise EngineProcessError(self.replicas[0].dead or "no engine replica serves")
        newest = max(self.replicas[i].version for i in live)
        fresh = [i for i in live if self.replicas[i].version == newest]
        return min(fresh, key=lambda i: (self._requests[i], self._tokens[i], self.routed[i]))

    async def generate(self, prompt_tokens: list[int], params: SamplingParams) -> Generation:
        i = self._pick()
        cost = len(prompt_tokens) + params.max_new_tokens
        self._requests[i] += 1
        self._tokens[i] += cost
        self.routed[i] += 1
        try:
            return await self.replicas[i].generate(prompt_tokens, params)
        finally:
            self._requests[i] -= 1
            self._tokens[i] -= cost

    # -- weights -----------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The lowest version a live replica holds (every replica's, when none is live)."""
        live = self._live() or range(len(self.replicas))
        return min(self.replicas[i].version for i in live)

    @property
    def confirmed_version(self) -> int:
        """The lowest version a live replica confirmed (``confirmed_version``, else ``version``)."""
        live = self._live() or range(len(self.replicas))
        return min(confirmed_version(self.replicas[i]) for i in live)

    def _behind(self, version: int) -> list[InferenceEngine]:
        return [r for r in self.replicas if not r.dead and r.version < version]

    def load_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        for replica in self._behind(version):
            replica.load_weights(state_dict, version)

    def load_version(self, weights_root: str, policy: str, version: int, *, use_deltas: bool = False,
                     full_resync_every: int = 10) -> None:
        """Every live replica below ``version`` reads it, all at once (a replica whose load
        blocks, a simulated one's, does not hold up the next). One that dies meanwhile is left
        to the node's restart (which loads the newest version into it); the others still get it."""
        behind = self._behind(version)

        def load(replica: InferenceEngine) -> None:
            try:
                replica.load_version(weights_root, policy, version, use_deltas=use_deltas,
                                     full_resync_every=full_resync_every)
            except EngineProcessError as err:
                log.warning("an engine replica of %s died before it could load v%d: %s", policy, version, err)

        if len(behind) <= 1:
            for replica in behind:
                load(replica)
            return
        with ThreadPoolExecutor(len(behind), thread_name_prefix="replica-load") as pool:
            for done in [pool.submit(load, r) for r in behind]:
                done.result()

    @property
    def loads_versions_itself(self) -> bool:
        return self.replicas[0].loads_versions_itself

    def take_load_records(self) -> list[dict[str, Any]]:
        return [{**rec, "replica": i} for i, r in enumerate(self.replicas) for rec in r.take_load_records()]

    # -- capabilities and lifecycle ----------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self.replicas[0].pid

    @property
    def dead(self) -> str | None:
        """Why the pool cannot serve at all (every replica dead); None while one serves."""
        return None if self._live() else self.replicas[0].dead

    @property
    def restartable(self) -> bool:
        return all(r.restartable for r in self.replicas)

    def restart(self) -> None:
        """Restart every dead replica (blocking)."""
        for replica in self.replicas:
            if replica.dead:
                replica.restart()

    def stats(self) -> dict[str, float]:
        """The replicas' counters summed (``busy_seconds`` is engine-seconds), and ``replicas``."""
        out = dict.fromkeys(STAT_KEYS, 0.0)
        for replica in self.replicas:
            for k, v in replica.stats().items():
                out[k] = out.get(k, 0.0) + float(v)
        out["replicas"] = float(len(self.replicas))
        return out

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()


def replicas_of(engine: InferenceEngine) -> tuple[InferenceEngine, ...]:
    """The engines that serve ``engine``'s requests: a pool's replicas, or the engine itself
    (what the node restarts one by one when they die)."""
    return engine.replicas if isinstance(engine, EnginePool) else (engine,)


def dead_engines(engines: Mapping[str, InferenceEngine]) -> list[tuple[str, InferenceEngine]]:
    """``(label, engine)`` of every dead engine process of a node's ``engines`` (by policy):
    a policy's engine, or one replica of its pool."""
    return [(p if len(reps) == 1 else f"{p} (replica {i})", r) for p, e in engines.items()
            for reps in [replicas_of(e)] for i, r in enumerate(reps) if r.dead]


def serving(engines: Mapping[str, InferenceEngine], reviving: list[InferenceEngine]) -> bool:
    """Whether every policy has an engine that serves and is not among ``reviving`` (being
    restarted and caught up): then the node can lease while the others restart."""
    return all(any(not r.dead and all(r is not x for x in reviving) for r in replicas_of(e))
               for e in engines.values())


def engine_pids(engines: Mapping[str, InferenceEngine]) -> dict[str, int]:
    """The engine processes by policy (``policy#i``: replica i > 0 of a policy's pool)."""
    return {p if i == 0 else f"{p}#{i}": r.pid for p, e in engines.items()
            for i, r in enumerate(replicas_of(e)) if r.pid is not None}
