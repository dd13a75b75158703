"""A RaaS (rollout-as-a-service) node: lease tasks, run workflows, write trajectories, pull
weights. It knows nothing about trainers, other nodes or the job scheduler.

The node runs as a Dask actor; ``start()`` launches its loop in a thread with its own asyncio
event loop, where three coroutines overlap:

* the *lease loop* keeps up to ``capacity`` episodes in flight (``lease`` from the data layer,
  one asyncio task per episode; the engine batches their generation requests; a node with
  several engines per policy, one per GPU by default, spreads them: ``engine_pool``);
* the *writer* writes finished trajectories to this node's own segments of the trajectory store
  (a series of bounded ones per start of the node: ``storage.trajectories.rotating``) in batches,
  and only after the write returned (entries committed) reports them with ``complete``.
  Invariant: a task is never completed before its trajectory is readable (the episodes and the
  writer: ``node_episodes``);
* the *weight watcher* polls the weight store and loads the newest committed version into the
  engine (skipping those in between), also while episodes are in flight (partial rollout:
  tokens after the swap carry the new version).

A heartbeat renews the leases of the tasks the node still works on and carries its stats. A
node that vanishes loses nothing: its leases expire and the data layer requeues them.

Failure containment: an exception of any type in an episode fails that task only (requeued up
to ``dataflow.max_attempts``); rewards run off the loop under ``rollout.reward_timeout_s``, and a
whole episode is cancelled (its task failed) past ``rollout.episode_timeout_s``. Dead engine
processes are restarted within a budget (``engine_recovery``). A loop that dies (writer, weight
watcher, a data-layer call) sends a last heartbeat with its error, and the orchestrator
replaces the node (also one that went silent). Something that blocks the loop itself is logged
with the stack it is stuck in (``loop_watchdog``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid
from typing import Any

from astraflow.rollout.config import RolloutConfig
from astraflow.rollout.pacing import LeasePacing

from astraflow.workloads.config import SamplingConfig
from astraflow.contracts import RolloutTask, Trajectory
from astraflow.rollout.engine import InferenceEngine, SamplingParams
from astraflow.rollout.engine_pool import dead_engines, engine_pids, replicas_of, serving
from astraflow.rollout.engine_recovery import EngineRecovery
from astraflow.rollout.loop_watchdog import unwatch_loop, watch_loop
from astraflow.rollout.engines import make_engines
from astraflow.rollout.failure_log import FailureLog
from astraflow.rollout.identity import NodeIdentity
from astraflow.rollout.node_episodes import NodeEpisodes
from astraflow.rollout.process_engine import EngineProcessError
from astraflow.rollout.shared_loop import shared_loop
from astraflow.rollout.weight_sync import WeightPuller
from astraflow.transport import FollowsDataLayer, Link, bind, call, call_sync
from astraflow.rollout.workflows import PolicyEngines, make_workflow
from astraflow.sandbox import SandboxConfig, configure as configure_sandbox
from astraflow.workloads.base import make_workload
from storage.trajectories import open_trajectory_store
from storage.trajectories.rotating import RotatingWriter

log = logging.getLogger("astraflow.rollout")

#: seconds between a node's heartbeats, which renew its leases; a run's ``dataflow.lease_seconds``
#: must span a few of them (``astraflow.dataflow.config.MIN_LEASE_SECONDS``)
HEARTBEAT_SECONDS = 1.0
#: seconds between the log lines of a weight-store failure that lasts (its traceback comes first)
REPEAT_LOG_S = 60.0


class RaaSNode(NodeEpisodes, EngineRecovery, FollowsDataLayer):
    """Dask actor: one rollout service."""

    def __init__(
        self,
        *,
        identity: NodeIdentity,
        rollout: RolloutConfig,
        models: dict[str, str],
        workload_name: str,
        workload_params: dict[str, Any],
        workload_seed: int,
        workflow: str,
        sampling: SamplingConfig,
        store_url: str,
        weights_root: str,
        data_layer: Any,
        seed: int = 0,
        run_seed: int = 0,
        use_deltas: bool = False,
        sandbox: SandboxConfig | None = None,
        gpus: int = 0,
    ):
        self.identity = identity
        self.cfg = rollout
        self.models = dict(models)
        self.dl = Link(data_layer, "the data layer")  # swapped by ``reconnect``
        self.store_url = store_url
        self.weights_root = weights_root
        #: the engines' own seed (requests without one), and the run's: an episode's requests are
        #: seeded from the run's seed and its task (``seeds.episode_seeds``), whichever node runs it
        self.seed, self.run_seed = seed, run_seed
        self.use_deltas = use_deltas
        #: GPUs the node's partition gives it (``gpus_per_node``): its engines spread over them
        self.gpus = gpus
        #: episodes in flight at most (``rollout.capacity``, or derived from the engine's hardware)
        self.capacity = rollout.node_capacity(gpus)
        self._sandbox = sandbox
        self._workload_args = (workload_name, workload_params, workload_seed)
        self._workflow_name = workflow
        self._sampling = SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, max_new_tokens=sampling.max_new_tokens
        )
        self.engines: dict[str, InferenceEngine] = PolicyEngines()
        #: the weight watcher's puller; None until ``start()`` has loaded the engines
        self.puller: WeightPuller | None = None
        #: episodes being generated (they count against ``capacity``)
        self.inflight: dict[str, RolloutTask] = {}
        #: finished episodes not yet written and completed (their leases are still held)
        self.writing: set[str] = set()
        self.counters: dict[str, float] = {
            "episodes": 0, "sequences": 0, "tokens": 0, "failed": 0, "idle_s": 0.0,
            "write_s": 0.0, "commit_s": 0.0, "lease_s": 0.0, "lease_calls": 0, "leased": 0, "complete_calls": 0,
            "weight_loads": 0, "engine_restarts": 0,
        }
        #: restarting dead engine processes (``_recover``): no leases meanwhile, unless every
        #: policy has an engine replica that still serves
        self._recovery: asyncio.Task | None = None
        #: the engines ``_recover`` is restarting and catching up
        self._reviving: list[InferenceEngine] = []
        self.error: str | None = None
        #: (errno, filename) when the error was an ``OSError``: the orchestrator tells a full disk apart
        self.error_os: tuple[int, str | None] | None = None
        self.draining = False
        self.stopped = False
        #: when a stopping node gives up waiting for its in-flight episodes (set by ``stop``)
        self._give_up_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started_at = time.time()
        self._segment_batches: collections.Counter = collections.Counter()  # per segment: batches not yet completed
        self._segments_closed: list[str] = []  # closed by the writer, some of their batches not completed yet
        self._failure_log = FailureLog(identity.name)  # a traceback per failure reason, then counts

    # ------------------------------------------------------------------ actor API
    def start(self) -> dict[str, int]:
        """Load engines, catch up to the latest committed weights, start the loop. Returns the
        weight version loaded per policy (the node leases only after this catch-up)."""
        bind(self.dl)
        self.store = open_trajectory_store(self.store_url, "a")
        # a segment of this incarnation's own: a node of the same name started while an earlier
        # one still writes (a partitioned worker replaced) never shares its writer's segment
        segment = f"{self.identity.name}.{uuid.uuid4().hex[:8]}"
        self.writer = RotatingWriter(self.store, segment, self.cfg.write_batch, self.cfg.segment_max_entries)
        workload = make_workload(*self._workload_args)
        if self._sandbox is not None:  # the run's ``sandbox:`` for the rewards that run code here
            sandbox = configure_sandbox(self._sandbox)
            if getattr(workload, "uses_sandbox", False):
                sandbox.check()  # a node without a working sandbox fails its start, not every episode
        self.workflow = make_workflow(self._workflow_name, workload, self._sampling, self.identity.name,
                                      reward_timeout_s=self.cfg.reward_timeout_s)
        # every policy's engines load side by side
        self.engines.update(make_engines(self.cfg.engine, self.models, seed=self.seed, gpus=self.gpus))
        prepare = getattr(self.workflow, "prepare", None)
        if prepare is not None:  # what the workflow checks once the engines are there (chat templates)
            prepare(self.engines)
        self.puller = WeightPuller(self.weights_root, self.engines, full_resync_every=self.cfg.full_resync_every,
                                   use_deltas=self.use_deltas)
        self.puller.poll()
        if self.cfg.nodes_per_worker > 1:  # one loop for all the nodes of the process
            self._thread = shared_loop().run(self._guarded())
        else:
            self._thread = threading.Thread(target=self._run, name=f"raas-{self.identity.name}", daemon=True)
            self._thread.start()
        return self.versions()

    def refresh(self) -> dict[str, int]:
        """Load any newer committed weights now (a driver's explicit sync point)."""
        self.counters["weight_loads"] += self.puller.poll()
        return self.versions()

    def versions(self) -> dict[str, int]:
        return {p: int(e.version) for p, e in self.engines.items()}

    def drain(self) -> None:
        """Stop leasing; in-flight episodes finish and are written."""
        self.draining = True

    def stop(self, timeout: float = 30.0) -> dict[str, Any]:
        """Drain, flush everything written, stop the loop (within ``timeout``: episodes still
        running a few seconds before it are abandoned, so that what finished is written)."""
        self.draining = True
        self._give_up_at = time.time() + max(timeout - min(5.0, timeout / 2), 0.0)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.stopped = self._thread is None or not self._thread.is_alive()
        st = self.state()
        for engine in self.engines.values():
            engine.close()
        writer = getattr(self, "writer", None)
        if self.stopped and writer is not None:  # its last batch is committed: end its committer, free the segment
            writer.close()
        return st

    def state(self) -> dict[str, Any]:
        stats = {p: e.stats() for p, e in self.engines.items()}
        elapsed = max(time.time() - self._started_at, 1e-9)
        return {
            "node": self.identity.name,
            "partition": self.identity.partition,
            "region": self.identity.region,
            "hardware": self.identity.hardware,
            "versions": self.versions(),
            "inflight": len(self.inflight),
            "writing": len(self.writing),
            "draining": self.draining,
            "stopped": self.stopped,
            "error": self.error,
            "counters": dict(self.counters),
            "generated_tokens_per_s": self.counters["tokens"] / elapsed,
            "episodes_per_s": self.counters["episodes"] / elapsed,
            "engine": stats,
            "engine_replicas": {p: len(replicas_of(e)) for p, e in self.engines.items()},
            "weight_sync": self.puller.recent(5) if self.puller is not None else [],
        }

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._guarded())
        finally:
            loop.close()

    async def _guarded(self) -> None:
        """The node's loop, on a thread's own event loop (``_run``) or on the shared one."""
        self._loop = asyncio.get_running_loop()
        watchdog = watch_loop(self.identity.name)  # names what blocks the loop, should anything do so
        try:
            await self._main()
        except BaseException as err:  # whatever stopped the loop is logged and reported, once
            self.error, self.draining = f"{type(err).__name__}: {err}", True
            if isinstance(err, OSError) and err.errno is not None:
                self.error_os = (err.errno, None if err.filename is None else str(err.filename))
            log.exception("RaaS node %s failed", self.identity.name)
            await asyncio.to_thread(self._last_word)
            if isinstance(err, asyncio.CancelledError) and asyncio.current_task().cancelling():
                raise  # the loop itself was cancelled: the cancellation goes on
            # not raised on: out of the node's thread, Python's thread-exception handler would log
            # it a second time; the orchestrator learns of it from the last heartbeat
        finally:
            self._failure_log.flush()  # the failures counted and not said yet
            unwatch_loop(watchdog, self.identity.name)

    def _last_word(self) -> None:
        """A dead loop's last heartbeat: its error (the orchestrator replaces the node), no lease renewed."""
        try:
            call_sync(self.dl.heartbeat, self.identity.name, self._beat_stats(holding=()), timeout=10)
        except Exception as err:  # the data layer may be what failed; silence is noticed too
            log.warning("node %s: the heartbeat with its error was not delivered: %s", self.identity.name, err)

    async def _main(self) -> None:
        """The node's loop: each turn heartbeats when due, leases for the free slots (unless the
        node drains or its engines are being restored), starts an episode per task, then waits
        for a free slot or paces an empty lease. A drained node leaves when nothing is left."""
        self._slot_free = asyncio.Event()
        self._new_weights = asyncio.Event()  # a newer version loaded: a long pause ends
        self.pacing = LeasePacing(self.cfg.lease_wait_seconds)
        self._finished: list = []  # generated (with its rows), waiting for the writer
        self._finished_event = asyncio.Event()
        self._closing = False
        writer = asyncio.create_task(self._writer(), name="the trajectory writer")
        watcher = asyncio.create_task(self._watch_weights(), name="the weight watcher")
        episodes: set[asyncio.Task] = set()
        last_beat = 0.0
        while not self._stop.is_set():
            for helper in (writer, watcher):
                if helper.done():  # it died: without it, finished episodes would hold their leases for ever
                    helper.result()
                    raise RuntimeError(f"{helper.get_name()} of node {self.identity.name} ended")
            self._slot_free.clear()  # a slot freed from here on (even during the lease call) ends the wait below
            self._failure_log.flush(due_only=True)  # failures counted for a minute: one line per reason
            if time.time() - last_beat > HEARTBEAT_SECONDS:
                last_beat = time.time()
                reply = await call(self.dl.heartbeat, self.identity.name, self._beat_stats(), timeout=30)
                if reply["draining"]:
                    self.draining = True
            recovering = self._recovering()
            self._new_weights.clear()  # a load from now on ends this turn's pause (one earlier was seen)
            for task in await self._lease_free_slots(recovering):
                self.inflight[task.task_id] = task
                ep = asyncio.create_task(self._episode(task))
                episodes.add(ep)
                ep.add_done_callback(episodes.discard)
            await self._wait_for_a_slot()
            if self.draining and not self.inflight and not self.writing:
                break
        await self._drain(episodes, writer, watcher)

    def _recovering(self) -> bool:
        """Whether the node's engines are being restored and none serves meanwhile; an engine that
        died while the node was idle starts its recovery here (not while the node stops: scancel
        ends the engine processes too)."""
        recovering = self._recovery is not None and not self._recovery.done()
        if not recovering and self.error is None and not self._stop.is_set() and dead_engines(self.engines):
            self._recovery = asyncio.get_running_loop().create_task(
                self._recover(EngineProcessError(dead_engines(self.engines)[0][1].dead)))
            recovering = True
        return recovering and not serving(self.engines, self._reviving)

    async def _lease_free_slots(self, recovering: bool) -> list[RolloutTask]:
        """Tasks for the free slots: a long poll, which the data layer answers as soon as it has
        tasks; none while the node drains or recovers."""
        free = self.capacity - len(self.inflight)
        if free <= 0 or self.draining or recovering:
            return []
        t0 = time.time()
        tasks = await call(self.dl.lease, self.identity.name, free, self.cfg.lease_wait_seconds,
                           versions=self.versions(), timeout=30)
        self.pacing.leased(len(tasks), time.time() - t0)
        self.counters["lease_s"] += time.time() - t0
        self.counters["lease_calls"] += 1
        self.counters["leased"] += len(tasks)
        return tasks

    async def _wait_for_a_slot(self) -> None:
        """With slots free, the lease pacing's pause (the data layer had too few tasks: ask again);
        with none, until an episode frees one (at most a second: the heartbeat may be due)."""
        t0, was_idle = time.time(), not self.inflight
        if len(self.inflight) < self.capacity and not self.draining:
            await self.pacing.pause(self._new_weights)
        else:
            try:
                await asyncio.wait_for(self._slot_free.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
        if was_idle:  # nothing was generating during this wait
            self.counters["idle_s"] += time.time() - t0

    async def _drain(self, episodes: set[asyncio.Task], writer: asyncio.Task, watcher: asyncio.Task) -> None:
        """The way out: in-flight episodes finish (or are cancelled past the give-up time, their
        tasks requeued), the writer flushes, and a last heartbeat carries the final counters and
        the error a failed node stopped on."""
        if episodes:
            await asyncio.wait(episodes,
                               timeout=60 if self._give_up_at is None else max(self._give_up_at - time.time(), 0))
        abandoned = [ep for ep in episodes if not ep.done()]
        for ep in abandoned:  # each reports its task failed (requeued now), not renewed by the last heartbeat
            ep.cancel("the node stopped before the episode finished")
        if abandoned:
            await asyncio.wait(abandoned, timeout=10)
        self._closing = True
        self._finished_event.set()
        await writer
        watcher.cancel()
        if self._recovery is not None and not self._recovery.done():  # a stop does not wait for a model load
            self._recovery.cancel()
            await asyncio.wait([self._recovery], timeout=5)
        try:
            await call(self.dl.heartbeat, self.identity.name, self._beat_stats(), timeout=10)
        except Exception as err:  # the data layer may be gone already at the end of a run
            log.info("node %s: last heartbeat not delivered: %s", self.identity.name, err)

    def _beat_stats(self, holding: Any = None) -> dict[str, Any]:
        """What a heartbeat carries; ``holding``: the tasks whose leases to renew (default: those
        being generated or written)."""
        return {
            "holding": list(self.inflight.keys() | self.writing if holding is None else holding),
            "versions": self.versions(),
            "inflight": len(self.inflight),
            "slots": self.capacity,  # for the rollout-ahead bound, also while its leases are served from a stock
            "episodes": self.counters["episodes"],
            "tokens": self.counters["tokens"],
            "partition": self.identity.partition,
            "region": self.identity.region,
            "hardware": self.identity.hardware,
            "worker": self.identity.worker,
            "generated_tokens_per_s": self.counters["tokens"] / max(time.time() - self._started_at, 1e-9),
            # share of its life the node had nothing to generate: rollout capacity to spare
            "idle_fraction": self.counters["idle_s"] / max(time.time() - self._started_at, 1e-9),
            "engine_restarts": self.counters["engine_restarts"],
            "engine_pids": engine_pids(self.engines),
            # a node that stopped leasing after an error it could not recover from: the
            # orchestrator replaces its worker (``Fleet.replace_failed_nodes``, ``astraflow/runtime/workers.py``)
            "error": self.error,
            "error_os": self.error_os,
        }

    async def _watch_weights(self) -> None:
        said, said_at = "", 0.0  # a failure that lasts (a damaged version) is logged once a minute, not every poll
        while True:
            try:
                loaded = await asyncio.to_thread(self.puller.poll)
                self.counters["weight_loads"] += loaded
                if loaded:
                    self._new_weights.set()
                said = ""
            except EngineProcessError:
                pass  # the engine died: ``_recover`` restarts it and loads the newest version
            except Exception as err:  # e.g. shared storage briefly unreadable: the next poll tries again
                why = f"{type(err).__name__}: {err}"
                if why != said:
                    log.exception("node %s: polling the weight store failed", self.identity.name)
                    said, said_at = why, time.monotonic()
                elif time.monotonic() - said_at >= REPEAT_LOG_S:
                    log.warning("node %s: polling the weight store still fails (%s)", self.identity.name, why)
                    said_at = time.monotonic()
            await asyncio.sleep(self.cfg.weight_poll_seconds)
